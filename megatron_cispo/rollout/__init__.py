"""Real rollouts from YAML: the prompt stream read from a JSONL or Parquet file (prompts), the user's
reward function run with a timeout in a worker process (rewards, reward_worker), the shipped arithmetic
task (arith), and vLLM's offline engine in its own process (vllm_engine: the trainer side, which never
imports vllm; vllm_worker: the child); child holds the pipe and start-up both worker processes
share. Runner floor: it may import hf and runner, never demo or train."""
