"""docs/integration.md section 3 as a script: an in-house loop trains a tiny GPT with megatron_cispo.

    torchrun --nproc-per-node 2 docs/examples/fork_step.py            # 2 ranks, data parallel
    torchrun --nproc-per-node 2 docs/examples/fork_step.py --tp 2     # 2 ranks, tensor parallel
    python docs/examples/fork_step.py                                 # 1 process (CPU)
On GPUs the set-up is megatron-core's own (NCCL); on a CPU-only host (tests) it is
megatron_cispo.runner.distributed.init_distributed (gloo and the CPU compatibility layer).
Rank 0 prints one JSON line per step. The doc quotes the blocks between "# --- doc" and
"# --- end" verbatim; tests/e2e/test_fork_example.py runs this file and checks the quotes.
"""
import argparse
import json
import os

import torch

V, S, N, PROMPT = 64, 16, 8, 4  # vocabulary, targets per row, global rows per step, prompt tokens


def set_up(tp: int) -> None:
    # --- doc: set-up
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    if torch.cuda.is_available():  # GPUs: megatron-core's usual set-up, nothing of megatron_cispo
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
        mpu.initialize_model_parallel(tensor_model_parallel_size=tp)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
    else:  # CPU (tests): megatron-core 0.16 needs CUDA in the seed call above, in DDP and in grad clipping
        from megatron_cispo.runner.distributed import init_distributed

        init_distributed(tp=tp, seed=1234)  # gloo, the same parallel state, the CPU compatibility layer
    # --- end


def build(tp: int):
    # --- doc: model
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    from megatron_cispo import set_megatron_hooks

    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, tensor_model_parallel_size=tp,
                               hidden_dropout=0.0, attention_dropout=0.0,
                               use_cpu_initialization=not torch.cuda.is_available(),
                               calculate_per_token_loss=True)  # the loss contract: the global token mean
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=V,
                     max_sequence_length=S, parallel_output=True)  # logits stay [b, s, v/tp]
    if torch.cuda.is_available():
        model.cuda()
    ddp_config = DistributedDataParallelConfig(average_in_collective=False)  # megatron divides by the tokens
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3), [model])
    set_megatron_hooks([model], optimizer)  # what Megatron-LM's train() sets on the model config
    # --- end
    return model, optimizer


def sample(model, step: int, device):
    """Stand-in for your sampler: random rows, the policy's own logprobs with some noise as the
    sampler's, and a toy reward (the share of low token ids) as group-normalised advantages."""
    from megatron_cispo import Rollouts, StepConfig
    from megatron_cispo.step import compute_logprobs

    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, V, (N, S + 1), generator=g)
    lengths = torch.randint(PROMPT + 2, S + 2, (N,), generator=g)  # real tokens per row, padding after
    pos = torch.arange(S)[None]
    loss_mask = (pos >= PROMPT - 1) & (pos < lengths[:, None] - 1)  # response targets only
    reward = ((tokens[:, 1:] < V // 2) & loss_mask).sum(1) / loss_mask.sum(1)
    advantages = (reward - reward.mean()) / (reward.std() + 1e-6)
    batch = Rollouts(tokens=tokens.to(device), loss_mask=loss_mask.to(device), lengths=lengths.to(device),
                     advantages=advantages.float().to(device))
    noise = 0.05 * torch.randn(N, S, generator=g).to(device)
    return batch.replace(rollout_logprobs=compute_logprobs([model], batch, StepConfig()) + noise)


def train_step(model, optimizer, rollouts, loss_cfg, step_cfg):
    # --- doc: step
    from megatron.core import parallel_state as mpu
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_cispo import make_forward_step, reduce_metrics
    from megatron_cispo.step.packing import microbatches, step_layout

    shard = rollouts.dp_shard(dp_rank=mpu.get_data_parallel_rank(), dp=mpu.get_data_parallel_world_size())
    mbs = microbatches(shard, loss_cfg, step_cfg, step_layout([model], step_cfg), mpu.get_data_parallel_group())
    forward_step = make_forward_step(loss_cfg, temperature=step_cfg.temperature, vocab_size=V)
    model.zero_grad_buffer()
    optimizer.zero_grad()
    reports = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(mbs), model=model, num_microbatches=len(mbs),
        seq_length=mbs[0].seq_length, micro_batch_size=mbs[0].input_ids.shape[0], forward_only=False)
    updated, grad_norm, _ = optimizer.step()
    metrics = reduce_metrics(reports, group=mpu.get_data_parallel_group(with_context_parallel=True))
    # --- end
    return {**metrics, "grad_norm": grad_norm, "updated": updated}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    from megatron_cispo import LossConfig, StepConfig
    from megatron_cispo.config import from_dict

    set_up(args.tp)
    model, optimizer = build(args.tp)
    device = next(model.parameters()).device
    loss_cfg = from_dict(LossConfig, {"cispo": {"anchor": "rollout"}})  # pi_old never needed: no extra pass
    step_cfg = StepConfig(micro_batch_size=2)
    before = [p.detach().clone() for p in model.parameters()]
    for step in range(args.steps):
        metrics = train_step(model, optimizer, sample(model, step, device), loss_cfg, step_cfg)
        moved = max(float((p.detach() - b).abs().max()) for p, b in zip(model.parameters(), before))
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps({"step": step, "moved": moved, **metrics}), flush=True)


if __name__ == "__main__":
    main()
