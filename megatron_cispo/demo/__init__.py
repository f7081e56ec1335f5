"""The demo's report: the runs' table and figure (python -m megatron_cispo.demo.report) and each run's
summary (finish_run). The demo itself is a YAML (yaml_configs/demo_cpu.yaml) run by launch/demo.sh; its
task and engines are in rollout/, its trainer loop in runner/loop.py.
"""
