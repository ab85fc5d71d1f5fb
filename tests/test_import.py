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


def test_optional_parts_name_their_extra_when_missing():
    # A None entry in sys.modules makes `import torch` / `import vllm...` fail as if absent.
    for module, blocked, extra in (
        ("kvoffload.transfer", "torch", "kvoffload[torch]"),
        ("kvoffload.vllm", "vllm", "kvoffload[vllm]"),
    ):
        code = (
            f"import sys; sys.modules[{blocked!r}] = None\n"
            f"try:\n    import {module}\nexcept ImportError as e:\n    print(e)"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert extra in out.stdout, (module, out.stdout, out.stderr)


def test_python_m_kvoffload_is_the_command():
    import kvoffload

    out = subprocess.run(
        [sys.executable, "-m", "kvoffload", "--version"], capture_output=True, text=True
    )
    assert (out.returncode, out.stdout.strip()) == (0, f"kvoffload {kvoffload.__version__}")
