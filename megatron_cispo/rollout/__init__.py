"""The rollout room: the engines behind one protocol (engine.py: torch_engine, hf_engine, vllm_engine),
the trainer's weights as named buckets (weight_stream, weight_receiver), the samplers (sampler: the
synthetic task; prompt_sampler: data.prompts, with async_feed), and prompts and rewards (task, prompts,
rewards, arith). Floor: it may import base and hf, never runner, demo or train."""
