"""Start-up cost of a rank: without CUDA, megatron-core loads without compiling its fused kernels
(runner.cpu_compat.import_megatron_core, called by init_distributed before megatron's first import)."""
import os
import subprocess
import sys
import textwrap


def test_megatron_core_loads_without_inductor_and_torch_compile_is_restored():
    code = textwrap.dedent("""
        import sys, torch
        compile_ = torch.compile
        from megatron_cispo.runner.cpu_compat import import_megatron_core
        import_megatron_core()
        import megatron.core.jit as jit
        assert torch.compile is compile_, "torch.compile was not restored"
        assert jit.jit_fuser is not compile_, "megatron's jit_fuser is still torch.compile"
        assert "torch._inductor" not in sys.modules, "Inductor was imported"
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
                               "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_the_cli_reaches_init_distributed_before_any_megatron_import():
    # Otherwise import_megatron_core finds megatron.core loaded (compiled) and does nothing.
    code = ("import sys, megatron_cispo.train, megatron_cispo.runner.loop, megatron_cispo.runner.distributed; "
            "print(sorted(m for m in sys.modules if m.startswith('megatron.')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr[-2000:]
