"""Each rank reads only its own slices of a Hugging Face checkpoint, one safetensors file at a time.

build_model(model.hf_path=...) runs with safetensors.safe_open wrapped to record every slice read
and how many files are open at once, on an 8-layer qwen2 (tied) stored in several files, at tp=2 and
at pp=2, and on qwen3_moe (4 experts) at ep=2. Every parameter element comes from exactly one
element read (the vocabulary padding rows from none), a pipeline stage reads no tensor of another
stage's layers, an expert-parallel rank none of another rank's experts, and at most one file is
mapped at a time (the mapped pages count in a rank's memory: docs/benchmarks.md).
"""
import re

import pytest

from megatron_cispo.testing import spawn

# an expert's global index in a megatron global name (SequentialMLP or TEGroupedMLP) and in an HF name
MEGATRON_EXPERT = re.compile(r"layers\.(\d+)\.mlp\.experts\.(?:local_experts\.(\d+)\.|linear_fc\d\.weight(\d+)$)")
HF_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")


class _Recorder:
    """safe_open(file, framework) -> a handle that logs its slices' reads into `self.reads`
    (tensor name, elements) and tracks the handles open at once."""

    def __init__(self, real):
        self.real, self.reads, self.open, self.max_open = real, [], 0, 0

    def __call__(self, *args, **kwargs):
        rec, handle = self, self.real(*args, **kwargs)
        rec.open += 1
        rec.max_open = max(rec.max_open, rec.open)

        class Handle:
            closed = False

            def get_slice(self, name):
                sl = handle.get_slice(name)

                class Slice:
                    def get_shape(self):
                        return sl.get_shape()

                    def __getitem__(self, key):
                        t = sl[key]
                        rec.reads.append((name, t.numel()))
                        return t
                return Slice()

            def keys(self):
                return handle.keys()

            def close(self):  # on exit, or when the handle is dropped without one
                if not self.closed:
                    self.closed = True
                    rec.open -= 1

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.close()

            def __del__(self):
                self.close()
        return Handle()


def worker(layout: dict, path: str):
    import gc

    import safetensors
    import torch
    from megatron.core import parallel_state as mpu

    from megatron_cispo.hf.load import tensor_index
    from megatron_cispo.runner import distributed
    from megatron_cispo.runner.model import ModelConfig, build_model
    from megatron_cispo.base.param_names import global_param_name

    tp, pp, ep = (layout.get(k, 1) for k in ("tp", "pp", "ep"))
    distributed.init_distributed(tp=tp, pp=pp, ep=ep)
    cfg = ModelConfig(hf_path=path)
    tensor_index(path)  # the header scan (cached per process) is not a slice read
    real = safetensors.safe_open
    rec = safetensors.safe_open = _Recorder(real)
    try:
        gc.disable()  # a handle is closed when the loader drops it, not when a collection runs
        chunks = build_model(cfg, tp=tp, pp=pp, ep=ep, wrap_ddp=False)
    finally:
        gc.enable()
        safetensors.safe_open = real
    (chunk,) = chunks
    padding = (cfg.padded_vocab_size - cfg.vocab_size) * cfg.hidden_size  # all on the last TP rank (84 < 192 rows)
    pad_rows = sum(padding for n, _ in chunk.named_parameters()
                   if n.endswith(("word_embeddings.weight", "output_layer.weight")))
    last_tp = mpu.get_tensor_model_parallel_rank() == tp - 1
    layers = sorted({int(global_param_name(chunk, n).split(".")[2]) for n, _ in chunk.named_parameters()
                     if n.startswith("decoder.layers.")})
    experts = {(int(m[1]), int(m[2] or m[3])) for n, _ in chunk.named_parameters()
               if (m := MEGATRON_EXPERT.search(global_param_name(chunk, n)))}
    return {"read": sum(n for _, n in rec.reads), "names": sorted({name for name, _ in rec.reads}),
            "params": sum(p.numel() for p in chunk.parameters()), "padding": pad_rows if last_tp else 0,
            "layers": layers, "experts": sorted(experts), "max_open": rec.max_open, "open_after": rec.open,
            "total": sum(torch.Size(shape).numel() for _, shape in tensor_index(path).values())}


@pytest.mark.parametrize("layout,model", [({"tp": 2}, "qwen2_deep_sharded"), ({"pp": 2}, "qwen2_deep_sharded"),
                                          ({"ep": 2}, "qwen3_moe")], ids=["tp2", "pp2", "ep2"])
def test_each_rank_reads_its_own_slices_one_file_at_a_time(hf_models, layout, model):
    results = spawn(worker, 2, (layout, hf_models[model]))
    for rank, r in enumerate(results):
        assert r["max_open"] == 1 and r["open_after"] == 0, f"rank {rank}: {r['max_open']} files open at once"
        # row-parallel weights (o_proj, down_proj) are read as column slices: still only this rank's elements
        assert r["read"] == r["params"] - r["padding"], f"rank {rank}: read {r['read']} elements for {r}"
        if "ep" not in layout:  # under EP the attention and embeddings are whole on every rank
            assert r["read"] < r["total"] * 0.6, f"rank {rank} read {r['read']} of {r['total']} elements"
        read_layers = {int(n.split(".")[2]) for n in r["names"] if n.startswith("model.layers.")}
        assert read_layers == set(r["layers"]), f"rank {rank} read layers {sorted(read_layers)}, owns {r['layers']}"
        read_experts = sorted({(int(m[1]), int(m[2])) for n in r["names"] if (m := HF_EXPERT.match(n))})
        assert read_experts == r["experts"], f"rank {rank} read experts {read_experts}, owns {r['experts']}"
    if "ep" in layout:  # (layer, expert) pairs: two of the four experts per layer on each rank, none on both
        owned = [set(r["experts"]) for r in results]
        assert all(len(o) == 2 * 2 for o in owned) and not owned[0] & owned[1], owned
