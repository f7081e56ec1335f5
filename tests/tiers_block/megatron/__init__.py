"""megatron-core made unimportable: .ci/run puts tests/tiers_block first on PYTHONPATH for the test files
that tests/tiers.py says never reach megatron-core, so one that does fails on tier 1 (tests/unit/test_tiers.py)."""
raise ImportError("megatron-core is blocked here: tests/tiers.py judged this test file free of megatron-core, so CI "
                  "runs it on tier 1 only; it imports megatron after all, so tests/tiers.py misses an import "
                  "(python tests/tiers.py --why FILE) and must learn it")
