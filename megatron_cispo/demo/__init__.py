"""A fully-async RL demo on real megatron-core: task, sampler with weight sync, trainer loop.

`task` makes prompts and rewards, `gpt` and `sampler` are the sampler side (a plain-torch copy
of the policy that lags the trainer), `loop` runs the trainer (checkpoints via the runner),
`metrics` persists a run, `report` compares runs. Run it with `bash launch/demo.sh`.
"""
