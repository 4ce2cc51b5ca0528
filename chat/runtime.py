"""Wiring: settings → loaded model, chat template and one DecodeSession for the process."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

import models
from engine.config import ConfigError
from engine.device import configure_process, configure_threads, kernel_config, resolve_device, resolve_dtype
from engine.session import DecodeSession, open_session

from .conversation import Conversation
from .settings import Settings
from .template import ChatTemplate


@dataclass
class Runtime:
    settings: Settings
    loaded: models.LoadedModel
    session: DecodeSession
    template: ChatTemplate
    device: torch.device
    dtype: torch.dtype
    load_seconds: float
    dtype_reason: str = ""

    def conversation(self) -> Conversation:
        return Conversation(self.template, self.loaded.tokenizer, self.settings.ui.system_prompt,
                            think=self.settings.ui.think)


def open_runtime(settings: Settings, status=None) -> Runtime:
    """Load the model and open the session; `status(text)` reports progress (optional). The
    runtime's `settings` are these with the model's own sampling defaults where no one set a key
    (a previous model's dropped): callers continue with them."""
    report = status or (lambda text: None)
    t0 = time.perf_counter()
    configure_process()  # (the environment's diagnosis switches and folders, before any load)
    eng = settings.engine
    device = resolve_device(eng)
    dtype, why = resolve_dtype(eng, device, models.native_dtype(models.resolve(eng.model)))
    if device.type == "cpu":
        configure_threads(eng)
    loaded, session = _open(settings, device, dtype, report)
    if eng.dtype == "auto" and dtype == torch.float16 and not session.finite_on(_calibration_ids(loaded)):
        # fp16's range is 6.5e4: a model whose activations exceed it gives inf/nan; bf16 has fp32's range
        if hasattr(session, "close"):
            session.close()  # the tensor-parallel workers: they start again in bfloat16
        del loaded, session
        _free(device)
        dtype, why = torch.bfloat16, "auto: float16 overflowed on a calibration prompt, so bfloat16"
        report(why)
        loaded, session = _open(settings, device, dtype, report)
    template = ChatTemplate(loaded.chat_template, loaded.bos_token, loaded.eos_token)
    # the model's own sampling defaults, under every setting a person made (chat/settings.py)
    settings, notes = settings.with_model_defaults(loaded.sampling_defaults, loaded.sampling_source)
    loaded.notes.extend(notes)
    return Runtime(settings, loaded, session, template, device, dtype, time.perf_counter() - t0, why)


# A calibration text for the fp16 range check: prose, code and digits, so that common paths
# through the weights are exercised.
CALIBRATION = ("The quick brown fox jumps over the lazy dog. In 1905, Albert Einstein published four papers; "
               "def mean(xs): return sum(xs) / len(xs)  # 3.14159, 2.71828, 1e-9. ¿Qué tal? 東京は日本の首都です。")


def _calibration_ids(loaded: models.LoadedModel) -> list[int]:
    return loaded.tokenizer.encode(CALIBRATION, add_special_tokens=False).ids


def _free(device: torch.device) -> None:
    import gc
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _open(settings: Settings, device: torch.device, dtype: torch.dtype, report):
    eng = settings.engine
    group = shard = None
    if eng.tensor_parallel > 1:
        from engine import tensor_parallel
        from models.sharding import Shard
        models.sharding_plan(eng.model, eng.tensor_parallel)  # a checkpoint that cannot be split: one line, no workers
        report(f"starting {eng.tensor_parallel - 1} tensor-parallel workers")
        group = tensor_parallel.start(eng, device.type, dtype)
        shard = Shard(0, eng.tensor_parallel)
    if device.type == "cpu":
        try:
            models.select_cpu_isa(eng.cpu_isa)
        except models.CpuStepUnavailable as e:
            raise ConfigError(str(e), "cpu_isa") from None
    report(f"loading {eng.model}" + (f" (rank 0 of {eng.tensor_parallel})" if group else ""))
    loaded = models.load(eng.model, device, dtype, quantized=keeps_blocks(eng, device), shard=shard,
                         kernels=kernel_config(eng))
    rounding = models.rounding_by_default(loaded.model) if eng.cpu_int8 == "auto" else eng.cpu_int8
    if not models.use_int8_inputs(loaded.model, rounding != "off", wide=rounding == "wide") and eng.cpu_int8 in ("on", "wide"):
        report(f"cpu_int8: {eng.cpu_int8} changes nothing here: the model holds no GGUF blocks on the CPU "
               "(a GGUF file with quantized: auto on the CPU has them)")
    elif eng.cpu_int8 == "wide" and not getattr(loaded.model, "cpu_wide", False):
        report("cpu_int8: wide changes nothing here: no linear in the rows16 layout (Q4_0/Q4_1/Q5_0/Q5_1 in "
               "whole 16-row groups; Q8_0 with AVX-512 VNNI); the other blocks take fp32 inputs")
    report("allocating state" + (" and capturing the decode graph" if device.type == "cuda" else "")
           + ("; compiling the decode step (minutes the first time, less from Inductor's cache)"
              if eng.compile == "on" else ""))
    if (group is None and device.type == "cpu" and eng.cpu_kernel != "off" and eng.compile == "off"
            and models.cpu_step_pending(loaded.model, dtype)):
        report("building the CPU decode kernel (once: ~10-20 s; cached for later runs)")
    session = open_session(loaded.model, eng, device, dtype, loaded.eos_ids, link=group and group.link)
    if group is not None:
        group.ready()
        session = tensor_parallel.ParallelSession(session, group.link, group)
    if session.cpu_kernel_note:
        report(session.cpu_kernel_note)
        # (the C++ library could not be built or loaded here: the plan is the torch step's)
        loaded.plan = models.plan.make(loaded.model, device, dtype, kernel_config(eng).but(cpu_kernel=False))
    return loaded, session


def keeps_blocks(eng, device: torch.device) -> bool:
    """Whether a GGUF's quantized blocks are kept (the `quantized` setting): auto keeps them on the
    CPU; on CUDA a GGUF is dequantized unless quantized: on asks for the Triton block kernels (on
    the H200 they decode slower than bf16: bench/quant_bench.py)."""
    return eng.quantized == "on" or (eng.quantized == "auto" and device.type == "cpu")
