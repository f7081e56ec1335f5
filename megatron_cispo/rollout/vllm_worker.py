"""The child side of vllm_engine.VLLMEngine: the only module that imports vLLM. It builds vLLM's offline
engine in this process (in-process mode, its own single-process group) and answers requests on the
pipe of child.py (8-byte length + pickle): ("load", dir), ("generate", kwargs), ("close", None), and
with cfg["stream"] the weight-transfer calls (vllm_transfer.py): ("winit", init_info), ("wstart", None),
("wupdate", update_info), ("wfinish", None), ("wabort", None); each reply is ("ok", value) or ("error", one line).

    python -c "from megatron_cispo.rollout.vllm_worker import serve; serve()"   # started by VLLMEngine
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from .child import attach, cause, recv, send


def _check_cpu_head_dim(model_dir: str) -> None:
    """vLLM's CPU attention has kernels for a few head sizes only; any other fails deep inside the
    first forward with an opaque message, so refuse it here naming the family and the sizes."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        cfg = cfg.get("text_config", cfg)
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return  # not a config this check understands: vLLM's own loading names the problem
    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim not in sizes:
        raise ValueError(f"vLLM's CPU attention has no kernel for head_dim {head_dim} of this "
                         f"{cfg.get('model_type')} model (it supports {sizes})")


def _build(cfg: dict):
    from vllm import LLM

    _check_cpu_head_dim(cfg["model_dir"])
    extra = {}
    if cfg.get("stream"):  # weights arrive through the weight-transfer API: start on placeholder weights
        from .vllm_transfer import BACKEND, register

        register()
        extra = {"weight_transfer_config": {"backend": BACKEND}, "load_format": "dummy"}
    kwargs = dict(model=cfg["model_dir"], skip_tokenizer_init=True, enforce_eager=True, dtype=cfg["dtype"],
                  distributed_executor_backend="uni", logprobs_mode="processed_logprobs", max_logprobs=-1,
                  max_model_len=cfg["max_model_len"], seed=cfg["seed"], **extra)
    return LLM(**{**kwargs, **cfg["engine_kwargs"]})  # rollout.vllm (vllm_options.py) may turn enforce_eager off


def _check_reload(llm) -> None:
    """vLLM 0.32's CPU reload_weights leaves MoE layers wrong: reloading a tiny qwen3_moe's own weights
    moved its logprobs by up to 0.10 (a fresh engine: 7e-7), and new expert weights did not arrive
    (0.75 from the new model). Refuse rather than sample from a model that is neither."""
    from vllm.platforms import current_platform

    hf = llm.llm_engine.model_config.hf_text_config
    if current_platform.is_cpu() and (getattr(hf, "num_experts", 0) or getattr(hf, "num_local_experts", 0)):
        raise ValueError(f"vLLM's CPU reload_weights does not restore this {hf.model_type} model's MoE layers "
                         "(measured on vLLM 0.32: off by up to 0.10 in logprob after reloading the same "
                         "weights): weight sync into an MoE model needs vLLM on GPU")


def _retie_lm_head(worker) -> bool:
    """Run on vLLM's worker after reload_weights: a tied output layer shares the embedding's weight,
    which reload_weights replaces while it puts the head's old (CPU-packed) tensors back ("ParallelLMHead:
    Failed to load weights"): the logits stayed the old embedding's (max |dlogp| 1.5 after a reload). Tie
    it again and rebuild its kernels from the new weight."""
    model = worker.model_runner.get_model()
    head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
    if not getattr(worker.model_runner.model_config.hf_text_config, "tie_word_embeddings", False) or \
            head is None or embed is None:
        return False
    head.weight = embed.weight
    head.quant_method.process_weights_after_loading(head)
    return True


_TRANSFER = ("winit", "wstart", "wupdate", "wfinish", "wabort")


def _loaded(llm) -> None:
    """After new weights are in: tie the head again, and drop the prompt KV cached with the old weights
    (it gave wrong logprobs)."""
    llm.collective_rpc(_retie_lm_head)
    llm.reset_prefix_cache()


def _transfer(llm, op: str, arg) -> None:
    """One step of a push through vLLM's weight-transfer API (the worker's methods, vllm_transfer's engine)."""
    if op == "winit":
        _check_reload(llm)
        llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": arg})
    elif op == "wstart":
        llm.collective_rpc("start_weight_update")
    elif op == "wupdate":
        llm.collective_rpc("update_weights", kwargs={"update_info": arg})
    elif op == "wfinish":
        try:
            llm.collective_rpc("finish_weight_update")
        except BaseException:
            _abort(llm)  # a short push loads nothing: the worker must accept the next one
            raise
        _loaded(llm)
    else:
        _abort(llm)


def _abort(llm) -> None:
    from .vllm_transfer import abort_update

    llm.collective_rpc(abort_update)


def _position(flat, p: int, token: int, vocab: int, num: int):
    """(the sampled token's logprob, its kept set or None, whether the set may be cut off) at
    position p of FlatLogprobs `flat`: vLLM's processed logprobs are -inf outside the kept set, so the
    finite entries among the returned candidates are the set; with num (top_k + 1) candidates, a
    finite last one means ties at the k-th logit may have kept more than were returned."""
    s, e = flat.start_indices[p], flat.end_indices[p]
    ids, lps = flat.token_ids[s:e], flat.logprobs[s:e]
    lp = lps[ids.index(token)]
    if num == 0:
        return lp, None, False
    kept = sorted({i for i, v in zip(ids, lps) if v != float("-inf")})
    top = lps[1:] if num > 0 else lps  # with num > 0 vLLM puts the sampled token first, then the top num
    return lp, kept, num > 0 and len(top) >= num and top[-1] != float("-inf")


def _completions(outputs, vocab: int, num: int):
    """[[(token_ids, logprobs, finish_reason, kept)] per sample] per prompt, and the prompts whose kept
    sets may be cut off."""
    result, cut = [], []
    for i, out in enumerate(outputs):
        samples = []
        for c in sorted(out.outputs, key=lambda c: c.index):
            ids = list(c.token_ids)
            rows = [_position(c.logprobs, p, t, vocab, num) for p, t in enumerate(ids)]
            if any(r[2] for r in rows):
                cut.append(i)
            kept = None if num == 0 else [r[1] for r in rows]
            samples.append((ids, [r[0] for r in rows], c.finish_reason, kept))
        result.append(samples)
    return result, cut


def _generate(llm, vocab: int, *, prompts, n, max_new_tokens, temperature, top_k, top_p, seeds,
              stop_token_ids, kept_sets):
    from vllm import SamplingParams

    truncated = 0 < top_k < vocab or top_p < 1.0
    # candidates per token: the sampled one alone; with kept sets the top_k + 1 (a set is within the
    # top k unless logits tie at the k-th), or the whole vocabulary (-1) for top-p alone
    num = 0 if not (kept_sets and truncated) else top_k + 1 if 0 < top_k < vocab - 1 else -1

    def run(idx, k):
        params = [SamplingParams(n=n, max_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                 top_p=top_p, seed=seeds[i], stop_token_ids=stop_token_ids, logprobs=k,
                                 flat_logprobs=True, detokenize=False) for i in idx]
        outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in idx], params, use_tqdm=False)
        return _completions(outs, vocab, k)

    result, cut = run(range(len(prompts)), num)
    if cut:  # rare: redo those prompts (seeded per request: the same tokens) with every candidate
        redo, _ = run(cut, -1)
        for i, samples in zip(cut, redo):
            result[i] = samples
    return result


def serve() -> None:
    """The worker: build the engine, then answer requests until "close" or stdin closes."""
    attached = attach()  # vLLM's prints go to the log; Ctrl-C reaches the trainer, which closes us
    if attached is None:
        return
    reply, cfg = attached
    t0 = time.perf_counter()
    try:
        llm = _build(cfg)
        vocab = llm.llm_engine.model_config.get_vocab_size()
    except Exception as e:  # noqa: BLE001 - any failure is reported to the trainer as one line
        return send(reply, ("error", cause(e)))
    send(reply, ("ok", time.perf_counter() - t0))
    while True:
        try:
            op, arg = recv(0, None)
        except EOFError:
            return
        if op == "close":
            return send(reply, ("ok", None))
        try:
            value = None
            if op == "load":
                _check_reload(llm)
                llm.collective_rpc("reload_weights", kwargs={"weights_path": arg, "is_checkpoint_format": True})
                _loaded(llm)
            elif op in _TRANSFER:
                _transfer(llm, op, arg)
            else:
                value = _generate(llm, vocab, **arg, kept_sets=cfg["kept_sets"])
        except Exception as e:  # noqa: BLE001
            send(reply, ("error", cause(e)))
            continue
        send(reply, ("ok", value))
