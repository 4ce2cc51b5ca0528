import os

import pytest
import torch

torch.set_num_threads(2)

if os.environ.get("CHAT_CPU_ISA"):  # the C++ library's tests on another instruction set (test_cpu_isa.py)
    from models.kernels.cpu import step as _step
    _step.select_isa(os.environ["CHAT_CPU_ISA"])

if os.environ.get("TRITON_INTERPRET") == "1":  # kernels run in this process under Triton's interpreter
    try:
        import triton  # noqa: F401
    except ImportError:
        pass
    else:
        from tests.support.interpreted import PRELUDE
        exec(PRELUDE)  # (a loop over a runtime bound, under NumPy >= 2.4: interpreted.py)


@pytest.fixture(autouse=True)
def _process_switches(monkeypatch):
    """The process-wide switches and folders that models.configure sets (a test that opens a
    runtime configures the process from its environment, or calls models.kernels.switch): each
    test's own, put back after it."""
    from models import kernels
    from models.formats import checkpoints
    monkeypatch.setattr(checkpoints, "INDEX_DIR", checkpoints.INDEX_DIR)
    before = kernels.switches()
    yield
    kernels.switch(**before)


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture
def chat_here(capsys, monkeypatch):
    """`chat ...` in this process (no interpreter start): (exit status, stdout, stderr)."""
    from chat.__main__ import main
    from tests.support.paths import ROOT
    monkeypatch.chdir(ROOT)

    def run(*args):
        code = main([str(a) for a in args])
        captured = capsys.readouterr()
        return code, captured.out, captured.err
    return run


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """One tiny random checkpoint directory per dense architecture, with its HF model."""
    from tests.support.tiny import hf_model, write_checkpoint

    out = {}
    for kind in ("llama", "qwen2", "qwen3"):
        model = hf_model(kind)
        out[kind] = (write_checkpoint(kind, str(tmp_path_factory.mktemp(kind)), model=model), model)
    return out


@pytest.fixture(scope="session")
def smollm2_path():
    from models import resolve
    return resolve("smollm2")


@pytest.fixture(scope="session")
def smollm2():
    import models
    return models.load("smollm2")


@pytest.fixture(params=[pytest.param("cuda", marks=pytest.mark.gpu), "interpreter"])
def device(request):
    """A Triton kernel test's device: CUDA (gpu-marked), or the CPU under Triton's interpreter
    (TRITON_INTERPRET=1, a Triton importable), skipped where neither is at hand. Test files of
    kernels that take it by this name: test_quant_kernels.py, test_qplanar.py."""
    from models.kernels.cuda import base
    if request.param == "interpreter":
        if os.environ.get("TRITON_INTERPRET") != "1" or not base.ENABLED:
            pytest.skip("Triton's interpreter: set TRITON_INTERPRET=1 (and a Triton on PYTHONPATH)")
        return torch.device("cpu")
    if not base.ENABLED:
        pytest.skip("Triton is not installed here")
    return torch.device("cuda")
