"""Rollout inputs from YAML: the prompt stream read from a JSONL or Parquet file (prompts), the user's
reward function run with a timeout in a worker process (rewards), and the shipped arithmetic task
(arith). Runner floor: it may import hf and runner, never demo or train."""
