"""Megatron-LM checkouts for the checkout tests: MEGATRON_LM_DIR is one checkout or several joined
by os.pathsep, each test runs once per checkout. Sources are parsed, never imported: a function is
compiled alone from its AST into a namespace the test fills (stubs for logging, nvtx, ...).

    MEGATRON_LM_DIR=/mlm/core_v0.16.1:/mlm/core_v0.19.0:/mlm/main python -m pytest tests/unit -k megatron_lm_checkout
"""
from __future__ import annotations

import ast
import copy
import functools
import os
import sys
import types
from pathlib import Path

import pytest
import torch

ROOTS = [r for r in os.environ.get("MEGATRON_LM_DIR", "").split(os.pathsep) if r]
needs_checkout = pytest.mark.skipif(not ROOTS, reason="MEGATRON_LM_DIR is not set: no Megatron-LM checkout to test against")


class Checkout:
    def __init__(self, root: str):
        self.root = Path(root)

    @functools.lru_cache(maxsize=None)
    def tree(self, rel: str) -> ast.Module:
        path = self.root / rel
        if not path.is_file():
            pytest.fail(f"MEGATRON_LM_DIR entry {self.root} has no {rel}; point it at Megatron-LM checkouts")
        return ast.parse(path.read_text(), str(path))

    def node(self, rel: str, name: str):
        found = [n for n in self.tree(rel).body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name]
        assert found, f"{name} not found in {rel}"
        return found[0]

    def has(self, rel: str, name: str) -> bool:
        return any(getattr(n, "name", None) == name for n in self.tree(rel).body)

    def compile(self, rel: str, names, namespace: dict) -> dict:
        """Run the definitions `names` of `rel` (in order) in `namespace`; returns it."""
        module = ast.Module(body=[self.node(rel, n) for n in names], type_ignores=[])
        exec(compile(module, str(self.root / rel), "exec"), namespace)
        return namespace

    def signature_stub(self, rel: str, name: str):
        """A function with `name`'s parameters and defaults, annotations and body dropped."""
        stub = copy.deepcopy(self.node(rel, name))
        for a in stub.args.posonlyargs + stub.args.args + stub.args.kwonlyargs:
            a.annotation = None
        stub.body, stub.decorator_list, stub.returns = [ast.Pass()], [], None
        namespace: dict = {}
        exec(compile(ast.fix_missing_locations(ast.Module(body=[stub], type_ignores=[])), rel, "exec"), namespace)
        return namespace[name]

    def flag_defaults(self, rel: str = "megatron/training/arguments.py") -> dict:
        """dest -> default of every add_argument('--flag', ...) in `rel` (store_true: False)."""
        out = {}
        for n in ast.walk(self.tree(rel)):
            if not (isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "add_argument" and n.args
                    and isinstance(n.args[0], ast.Constant) and str(n.args[0].value).startswith("--")):
                continue
            kw = {k.arg: k.value for k in n.keywords}
            dest = kw["dest"].value if "dest" in kw else n.args[0].value[2:].replace("-", "_")
            if "default" in kw:
                try:
                    value = ast.literal_eval(kw["default"])
                except ValueError:
                    value = ast.unparse(kw["default"])
            else:
                action = kw.get("action")
                value = False if isinstance(action, ast.Constant) and action.value == "store_true" else None
            out.setdefault(dest, value)
        return out

    def core_version(self) -> str:
        found = {}
        for line in (self.root / "megatron/core/package_info.py").read_text().splitlines():
            key, _, value = line.partition("=")
            if key.strip() in ("MAJOR", "MINOR", "PATCH", "PRE_RELEASE"):
                found[key.strip()] = ast.literal_eval(value.strip())
        return f"{found['MAJOR']}.{found['MINOR']}.{found['PATCH']}{found['PRE_RELEASE']}"

    def load_file(self, rel: str, name: str) -> types.ModuleType:
        """A small self-contained module of the checkout (e.g. packed_seq_params.py), run alone."""
        module = sys.modules[name] = types.ModuleType(name)  # registered: dataclasses look their module up
        exec(compile((self.root / rel).read_text(), str(self.root / rel), "exec"), module.__dict__)
        return module


def thd_get_partitioned_indices(cu_seqlens, total_tokens, cp_size, rank):
    """Transformer Engine's THD context-parallel partition (CPU stand-in): every sequence is cut into
    2 * cp_size chunks and rank r owns chunks r and 2 * cp_size - 1 - r."""
    out = []
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        c = (end - start) // (2 * cp_size)
        out += list(range(start + rank * c, start + (rank + 1) * c)) + list(range(end - (rank + 1) * c, end - rank * c))
    return torch.tensor(out, dtype=torch.int32)


class _Nvtx:
    def __call__(self, *a, **k):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def rl_utils_of(checkout: Checkout, args, default_packed) -> types.ModuleType:
    """megatron.rl.rl_utils with the checkout's own get_logprobs (and what it calls) compiled alone;
    get_default_packed_seq_params is `default_packed`, Transformer Engine's partition the stand-in.
    Puts it into sys.modules (the caller restores what was there)."""
    import dataclasses
    import logging
    from contextlib import nullcontext
    from typing import Any

    psp = checkout.load_file("megatron/core/packed_seq_params.py", f"_checkout_{checkout.root.name}_packed_seq_params")
    rel = "megatron/rl/rl_utils.py"
    ns = {"torch": torch, "nullcontext": nullcontext, "copy": copy, "dataclass": dataclasses.dataclass, "Any": Any,
          "logging": logging, "logger": logging.getLogger("checkout"), "log_single_rank": lambda *a, **k: None,
          "get_args": lambda: args, "get_nvtx_range": lambda: _Nvtx(), "is_batch_invariant_mode_enabled": lambda: False,
          "get_default_packed_seq_params": default_packed, "PackedSeqParams": psp.PackedSeqParams,
          "is_pp_last_stage": lambda pp: pp is None or pp.rank() == pp.size() - 1,
          "HAVE_TEX": True, "tex": types.SimpleNamespace(thd_get_partitioned_indices=thd_get_partitioned_indices)}

    def get_attr_wrapped_model(model, attr):
        while not hasattr(model, attr) and hasattr(model, "module"):
            model = model.module
        return getattr(model, attr)

    ns["get_attr_wrapped_model"] = get_attr_wrapped_model
    if checkout.has("megatron/core/transformer/utils.py", "set_model_config_attribute"):
        checkout.compile("megatron/core/transformer/utils.py", ["set_model_config_attribute"], ns)
    names = [n for n in ("_CPScatterCache", "_build_cp_scatter_cache", "_scatter_for_context_parallel")
             if checkout.has(rel, n)]
    module = types.ModuleType("megatron.rl.rl_utils")
    module.__dict__.update(ns)
    module.__file__ = str(checkout.root / rel)
    sys.modules.update({"megatron.rl": types.ModuleType("megatron.rl"), "megatron.rl.rl_utils": module})
    checkout.compile(rel, ["selective_log_softmax", *names, "get_logprobs"], module.__dict__)
    return module


class PositionwiseGPT(torch.nn.Module):
    """A last-stage GPT whose logits [b, s, v] at a position depend on that token and position only,
    so a context-parallel rank's share of the tokens gives exactly those positions' logits. Records
    the PackedSeqParams and the token count of each call."""

    def __init__(self, pg_collection, vocab=13, hidden=6, seq=8, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.nn.Parameter(torch.randn(vocab, hidden, generator=g))
        self.pos = torch.nn.Parameter(torch.randn(seq, hidden, generator=g))
        self.out = torch.nn.Parameter(torch.randn(vocab, hidden, generator=g))
        self.config = types.SimpleNamespace(flash_decode=True)
        self.pg_collection, self.seen = pg_collection, []

    def forward(self, input_ids, position_ids, attention_mask, packed_seq_params=None, runtime_gather_output=None):
        assert self.config.flash_decode is False, "get_logprobs runs the training forward with flash-decode off"
        self.seen.append((packed_seq_params, input_ids.shape[1]))
        return torch.tanh(self.emb[input_ids] + self.pos[position_ids]) @ self.out.t()


class Float16Module(torch.nn.Module):
    """Megatron's wrapper as get_logprobs sees it: takes fp32_output (named so step.head.unwrap finds it)."""

    def __init__(self, module):
        super().__init__()
        self.module, self.config = module, module.config

    def forward(self, *args, fp32_output=True, **kwargs):
        out = self.module(*args, **kwargs)
        return out.float() if fp32_output else out


def params_seen(p) -> dict | None:
    """The fields of a PackedSeqParams that say what the model was asked to run."""
    if p is None:
        return None
    out = {}
    for name in ("qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "max_seqlen_q", "max_seqlen_kv", "total_tokens",
                 "pad_between_seqs", "local_cp_size"):
        value = getattr(p, name, None)
        out[name] = value.tolist() if isinstance(value, torch.Tensor) else value
    return out


def logprobs_pair(root: str, cp_group=None, sequence_packing: bool = False) -> dict:
    """The checkout's get_logprobs and the drop-in's (logits head, temperature 1) on the same
    position-wise model and batch [2, 8]: for each ("theirs", "ours") the logprobs, the gradients of
    (logprobs * w).sum() for the model's parameters, and what the model saw on each call."""
    from megatron_cispo.config import LossConfig
    from megatron_cispo.integrations import megatron_lm as mlm

    args = types.SimpleNamespace(fp16=False, bf16=False, rl_sequence_packing_max_sequences_per_bin=2)

    def default_packed(seq_length, max_sequences_per_bin, device):  # a bin of two sequences of 4
        cu = torch.tensor([0, 4, 8], dtype=torch.int32, device=device)
        return rl.PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=4, max_seqlen_kv=4)

    saved = {name: sys.modules.get(name) for name in ("megatron.rl", "megatron.rl.rl_utils")}
    rl = rl_utils_of(Checkout(root), args, default_packed)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 13, (2, 8), generator=g)
    positions = torch.arange(8).expand(2, 8)
    weights = torch.linspace(-1, 1, 14, dtype=torch.float64).view(2, 7)
    out = {}
    try:
        mlm.configure(LossConfig(head="logits"), temperature=1.0)
        for who, get_logprobs in (("theirs", rl.get_logprobs), ("ours", mlm.get_logprobs)):
            gpt = PositionwiseGPT(types.SimpleNamespace(pp=None, tp=None, cp=cp_group))
            lp = get_logprobs(Float16Module(gpt), tokens, positions, no_grad=False, sequence_packing=sequence_packing)
            (lp.double() * weights).sum().backward()
            out[who] = {"lp": lp.detach(), "grads": [p.grad for p in gpt.parameters()],
                        "seen": [(params_seen(p), n) for p, n in gpt.seen], "flash_decode": gpt.config.flash_decode}
    finally:
        mlm.configure(None)
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    return out


def cp2_worker(root: str) -> dict:
    """logprobs_pair at context parallelism 2 (the whole world is the CP group), unpacked and
    packed, and the drop-in's logprobs at CP 1 on the same batch."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        return {packed: {**logprobs_pair(root, dist.group.WORLD, packed),
                         "cp1": logprobs_pair(root, None, packed)["ours"]["lp"]} for packed in (False, True)}
    finally:
        dist.destroy_process_group()


def standin_cp2_worker() -> list:
    """No checkout: a main-like rl_utils (its get_logprobs splits CP; the split below does what
    main's _scatter_for_context_parallel does) and the drop-in's get_logprobs at CP 2 over gloo,
    against log_softmax of the full sequence on this rank: the logprobs, and the gradient summed over
    the CP ranks (each rank's all-gather backward sums both ranks' losses: 2x the full sequence's).
    Returns per-rank errors and token counts."""
    import torch.distributed as dist

    from megatron_cispo.config import LossConfig
    from megatron_cispo.integrations import megatron_lm as mlm

    dist.init_process_group("gloo")
    group, rank = dist.group.WORLD, dist.get_rank()

    def scatter(tokens, position_ids, packed_seq_params, cp_group):
        s, cp = tokens.shape[1], dist.get_world_size(cp_group)
        perm = torch.cat([thd_get_partitioned_indices(packed_seq_params.cu_seqlens_q, s, cp, r) for r in range(cp)]).long()
        mine = perm[dist.get_rank(cp_group) * s // cp:(dist.get_rank(cp_group) + 1) * s // cp]
        labels = torch.cat([tokens[:, 1:], tokens[:, -1:]], dim=1)
        return (tokens[:, mine], position_ids[:, mine], packed_seq_params, labels[:, mine],
                types.SimpleNamespace(cp_group=cp_group, inverse_gather_perm=torch.argsort(perm)))

    def main_get_logprobs(model, tokens, position_ids, no_grad=False, sequence_packing=False, packed_seq_params=None):
        PackedSeqParams(qkv_format="thd", cu_seqlens_q=0, cu_seqlens_kv=0, max_seqlen_q=0, max_seqlen_kv=0,  # noqa: F821
                        pad_between_seqs=False)
        _scatter_for_context_parallel(tokens, position_ids, packed_seq_params, None)  # noqa: F821

    from megatron.core.packed_seq_params import PackedSeqParams as Core  # 0.16.1's lacks pad_between_seqs

    rl = types.ModuleType("megatron.rl.rl_utils")
    rl.PackedSeqParams = lambda **kw: Core(**{k: v for k, v in kw.items() if k in Core.__dataclass_fields__})
    rl.get_logprobs, rl._scatter_for_context_parallel = main_get_logprobs, scatter
    rl.get_args = lambda: types.SimpleNamespace(fp16=False, bf16=False)
    rl.get_attr_wrapped_model = lambda model, attr: getattr(model, attr)
    rl.is_pp_last_stage = lambda pp: True
    sys.modules.update({"megatron.rl": types.ModuleType("megatron.rl"), "megatron.rl.rl_utils": rl})
    try:
        mlm.configure(LossConfig(head="logits"), temperature=1.0)
        tokens = torch.randint(0, 13, (2, 8), generator=torch.Generator().manual_seed(1))
        positions = torch.arange(8).expand(2, 8)
        gpt = PositionwiseGPT(types.SimpleNamespace(pp=None, tp=None, cp=group))
        lp = mlm.get_logprobs(gpt, tokens, positions)
        lp.sum().backward()
        split_grad = gpt.emb.grad.clone()  # this rank's positions only; DDP sums the CP ranks'
        dist.all_reduce(split_grad)
        gpt.emb.grad, gpt.config.flash_decode = None, False  # the reference forward, by hand
        full = torch.log_softmax(gpt(tokens, positions, None)[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]
        full.sum().backward()  # the all-gather's backward sums the 2 ranks' (identical) losses
        return [(lp - full).abs().max().item(), (split_grad - 2 * gpt.emb.grad).abs().max().item(),
                [n for _, n in gpt.seen], rank]
    finally:
        mlm.configure(None)
        dist.destroy_process_group()
