"""Our runner: what the CLI, the demo and the tests use to run megatron-core; not the library.

    loop.py        run(cfg): the trainer loop that runs every YAML
    experiment.py  the YAML experiment schema and loader (load_experiment, resolve_world)
    config_doc.py  docs/configuration.md from that schema
    model.py       GPTModel + DDP + megatron optimizer, with layout-independent init
    distributed.py init_distributed / shutdown: process groups and megatron parallel state
    cpu_compat.py  CpuCompat, the scoped layer that runs megatron-core 0.16.1 on CPU over gloo
    checkpoint.py  sharded, atomic per-rank checkpoints
The CPU compatibility layer is reachable from here only; the library never imports this package.
"""
