import subprocess
import sys


def test_import_is_light():
    # `import kvoffload` must not drag in torch or vllm: schedulers import it on the hot path.
    code = "import sys, kvoffload; print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_error_hierarchy():
    import kvoffload

    assert issubclass(kvoffload.InvalidStateError, kvoffload.KVOffloadError)
    assert issubclass(kvoffload.ConfigError, kvoffload.KVOffloadError)
    assert issubclass(kvoffload.ConfigError, ValueError)
