"""The planner: once a model is loaded, each op site (sites.py) is bound to the kernel that serves
it on the target device and dtype, by the first rule of table.py whose conditions hold under the
KernelConfig; the weights a rule repacks are repacked here (`bind`), so the plan is also what the
model then runs. `make` only reads: it plans for a device that need not be here (`chat plan
--device cuda` on a CPU host plans as a CUDA host with Triton would).

The rules' conditions ask serving.py, the one place that asks the kernels whether they serve (the
quantized linears' fits, the per-head kernels' sizes, the decode attention's); the ops ask the
same at call time, so the forwards follow the rules the plan states."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from ..quant import hf_layers, layers as quant
from .sites import Site, collect
from .config import DEFAULT, KernelConfig
from .table import DENSE, ROWS16_LAYOUT, Rule, rules_for

HALF = (torch.bfloat16, torch.float16)


class PlanError(RuntimeError):
    """A site no rule covers (a table without a catch-all for that op and device)."""


@dataclass
class Choice:
    site: Site
    kernel: str
    reason: str
    layout: str | None  # the layout the weights are repacked into at load; None: as stored
    rule: Rule = field(repr=False)


@dataclass
class Plan:
    device: str              # "cuda" or "cpu"
    dtype: torch.dtype
    config: KernelConfig
    choices: list[Choice]
    step: str                # what runs a decode step as a whole
    notes: list[str] = field(default_factory=list)
    kv_element_bytes: int = 2

    def decode_bytes(self) -> int:
        """Weight bytes one decode step reads: every linear and the head, a row of the
        embedding, top_k of each layer's routed experts."""
        return int(sum(c.site.decode_bytes for c in self.choices))

    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes a decode step reads per token of context (the attention layers')."""
        return sum(2 * c.site.dims.get("kv_heads", 0) * c.site.dims.get("head_dim", 0) * self.kv_element_bytes
                   for c in self.choices if c.site.op == "attention" and c.site.decode_share)

    def kernels(self) -> Counter:
        """How many op sites each kernel serves."""
        return Counter(c.kernel for c in self.choices)

    def summary(self) -> str:
        """One line: the step and the kernels by how many sites each serves (for /show and a
        recording's engine header: the same model, device, dtype and config give the same line)."""
        def name(kernel: str) -> str:  # (the C++ step's kernels, without the step's name again)
            return kernel.removeprefix("C++ step: ")
        counts = ", ".join(f"{name(k)} x{n}" for k, n in sorted(self.kernels().items(), key=lambda kv: (-kv[1], kv[0])))
        return f"{self.step}: {counts}"


def _device_type(device) -> str:
    return torch.device(device).type


def _triton(config: KernelConfig, device: str, notes: list[str]) -> bool:
    if device != "cuda":
        return False
    if config.triton is not None:
        return config.triton
    if torch.cuda.is_available():
        from .serving import enabled  # (here, not at import: `import models` loads no kernel module)
        return enabled()
    notes.append("no CUDA device here: planned as a CUDA host with Triton would run it")
    return True


@dataclass
class _Context:
    device: str
    dtype: torch.dtype
    config: KernelConfig
    triton: bool
    step: bool       # the C++ decode step serves this CPU model
    offers: bool     # the model's family has a C++ decode step (served or not)
    blocks: bool     # the C++ per-linear kernels serve its GGUF blocks
    tables: set      # storages of the embeddings' blocks (a head on one of them is tied)
    int8: bool       # cpu_int8: those kernels round their inputs (auto resolved for this model)


def _context(model: nn.Module, device: str, dtype: torch.dtype, config: KernelConfig, notes: list[str]) -> _Context:
    step = blocks = False
    offer = getattr(model, "offers_cpu_step", None) if device == "cpu" else None
    offers = bool(offer is not None and offer())
    if device == "cpu" and config.cpu_kernel:
        from .serving import cpu_blocks_served, cpu_step_serves
        step = offers and cpu_step_serves(model, dtype)
        blocks = cpu_blocks_served(model, dtype)
    tables = {_blocks_key(m) for m in model.modules() if isinstance(m, quant.BlockEmbedding)}
    int8 = quant.int8_by_default(model) if config.cpu_int8 is None else config.cpu_int8
    return _Context(device, dtype, config, _triton(config, device, notes), step, offers, blocks, tables, int8)


def _blocks_key(m: nn.Module) -> tuple:
    """What a tied head and its embedding hold in common: the same first tensor, as stored or
    as repacked (BlockEmbedding.share_layout)."""
    t = m.stored()[0]
    return t.data_ptr(), tuple(t.shape)


def _kernel_format(site: Site) -> tuple[str, int | None]:
    """The format name and group qlinear.fits reads for a linear as stored now."""
    m = site.module
    if isinstance(m, quant.QuantLinear):
        qw = m.qweight()
        return qw.fmt, qw.group
    return site.fmt, None


def _rows16_fits(m: nn.Module, ctx: _Context) -> bool:
    """A CPU matrix of a rows16 type (quant/rows16.py) in whole 16-row groups, cpu_rows16 on, the
    library's rows16 forms built here."""
    from ..quant import rows16
    from .serving import cpu_rows16_types
    return (ctx.config.cpu_rows16 and isinstance(m, quant.BlockLinear) and not m.planar and not m.stored()[0].is_cuda
            and rows16.fits(m.ggml_type, m.out_features) and m.ggml_type in cpu_rows16_types())


def _holds(cond: tuple, site: Site, ctx: _Context) -> bool:
    name, *arg = cond
    m = site.module
    if name in ("gt", "le"):
        limit = getattr(ctx.config, arg[0])
        return site.weights > limit if name == "gt" else site.weights <= limit
    if name in ("on", "off"):
        return bool(getattr(ctx.config, arg[0])) == (name == "on")
    if name in ("k", "not_k"):
        return (site.k % arg[0] == 0) == (name == "k")
    if name in ("tied", "untied"):
        tied = isinstance(m, quant.BlockLinear) and _blocks_key(m) in ctx.tables
        return tied == (name == "tied")
    if name in ("group", "not_group"):
        group = int(getattr(m, "group", 0))
        whole = group > 0 and group % arg[0] == 0 and site.k % group == 0
        return whole == (name == "group")
    if name in ("fits", "not_fits"):
        from .serving import quant_fits
        fmt, group = _kernel_format(site)
        return quant_fits(fmt, site.k, group) == (name == "fits")
    if name == "half":
        return ctx.dtype in HALF
    if name == "fp32":
        return ctx.dtype == torch.float32
    if name in ("triton", "no_triton"):
        return ctx.triton == (name == "triton")
    if name in ("step", "no_step"):
        return ctx.step == (name == "step")
    if name == "no_offer":
        return not ctx.offers
    if name == "blocks":
        return ctx.blocks
    if name == "head":
        return site.op == "lm_head"
    if name == "int4pack":
        return isinstance(m, quant.Int4Linear)
    if name == "int8":  # (with cpu_int8: wide only the rows16 matrices round: the others take fp32 inputs)
        return ctx.int8 and (not ctx.config.cpu_wide or _rows16_fits(m, ctx))
    if name == "rows16":
        return _rows16_fits(m, ctx)
    if name == "planar":
        return isinstance(m, quant.PlanarExperts) and bool(m.planar_halves)
    if name in ("attention_fits", "delta_fits", "ssd_fits"):
        from .serving import decode_attention_fits, fits
        d = site.dims
        if name == "attention_fits":
            return decode_attention_fits(d["head_dim"])
        if name == "delta_fits":
            return fits(d["dk"], d["dv"])
        return fits(d["head_dim"], d["state"])
    raise PlanError(f"unknown rule condition {cond!r}")


def _choose(site: Site, ctx: _Context) -> Choice:
    for rule in rules_for(site.op, ctx.device, site.source or site.fmt):
        if all(_holds(c, site, ctx) for c in rule.when):
            layout = rule.layout.get(site.source) if rule.layout else None
            return Choice(site, rule.kernel, rule.reason, layout, rule)
    raise PlanError(f"no rule serves {site.op} {site.name} ({site.fmt}) on {ctx.device}")


def _as_loaded(site: Site, dtype: torch.dtype) -> Site:
    """A dense site as a load in `dtype` holds it (a plan for another dtype than the model's now:
    the loader converts dense weights to the compute dtype)."""
    name = str(dtype).replace("torch.", "")
    if site.source in DENSE and site.source != name:
        old = torch.tensor([], dtype=getattr(torch, site.source)).element_size()
        site.nbytes = site.nbytes * torch.tensor([], dtype=dtype).element_size() // old
        site.fmt = site.source = name
    return site


def make(model: nn.Module, device, dtype: torch.dtype, config: KernelConfig = DEFAULT) -> Plan:
    """The plan for `model` as it is held now, on `device` in `dtype`; changes nothing."""
    device = _device_type(device)
    notes: list[str] = []
    ctx = _context(model, device, dtype, config, notes)
    choices = [_choose(_as_loaded(s, dtype), ctx) for s in collect(model)]
    if device == "cuda":
        step = "Triton kernels" if ctx.triton else "torch"
    else:
        step = "C++ decode step" if ctx.step else "torch eager step"
    kv = 2 if device == "cuda" or ctx.step else torch.tensor([], dtype=dtype).element_size()
    return Plan(device, dtype, config, choices, step, notes, kv)


def q4_in_blocks(device, dtype: torch.dtype, config: KernelConfig = DEFAULT) -> bool:
    """Whether a GGUF's Q4_0/Q4_1 linears stay in their blocks on the CPU (BlockLinear), for the
    library's products on rounded inputs, rather than in torch's int4 planes on fp32 inputs: with
    the C++ kernels on, in fp32, where cpu_int8 is on or wide, or auto and either the plan
    interleaves them (cpu_rows16: auto then rounds their inputs to 16 bits, models.rounding_by_default)
    or the library runs its AVX2 forms. The loader holds them so before a plan is made. The rows16
    products decode and prefill ahead of the planes on both instruction sets (bench/cpu_bench.py
    --cpu-int8 off | wide), and on 16-bit inputs the replies stay the fp32 model's
    (tests/e2e/test_e2e_pty.py; int8 inputs moved its near tie)."""
    if _device_type(device) != "cpu" or dtype != torch.float32 or not config.cpu_kernel:
        return False  # (the CPU's flags are not read for another device's load)
    from .serving import cpu_avx512_forms, cpu_library_enabled, cpu_rows16_forms
    if not cpu_library_enabled():
        return False
    return config.cpu_int8 is True or (config.cpu_int8 is None and
                                        ((config.cpu_rows16 and cpu_rows16_forms()) or not cpu_avx512_forms()))


def bind_forms(module: nn.Module) -> int:
    """Bind the CUDA forms (models/ops/quant.py) to every quantized module in `module` (itself
    included) that computes through them: the quantized linears, planar experts and GGUF
    embeddings. `bind` does it for a CUDA plan; a module built by hand (a benchmark's shape, a
    test's linear) asks for it here. The forms ask at call time whether they serve (device,
    switches, format), so a bound module on the CPU, or with the kernels switched off, runs its
    torch forms. Returns how many modules it bound."""
    from ..ops.quant import FORMS  # (here: a CPU load imports no CUDA kernel module)
    bound = 0
    for m in module.modules():
        if isinstance(m, (quant.QuantLinear, quant.PlanarExperts, quant.BlockEmbedding)):
            m.forms = FORMS
            bound += 1
    return bound


def bind(model: nn.Module, device, dtype: torch.dtype, config: KernelConfig = DEFAULT) -> Plan:
    """Plan, then repack the weights whose rule names a layout (CUDA: once, after fusion), and
    return the plan of the model as it now is. The only code that repacks a loaded model; on
    CUDA it binds the quantized modules' CUDA forms too (`bind_forms`)."""
    plan = make(model, device, dtype, config)
    if plan.device == "cuda":
        bind_forms(model)
    if plan.device == "cpu":
        made = [c.site.module.interleave() for c in plan.choices if c.layout in ROWS16_LAYOUT.values()]
        if any(made):
            plan = make(model, device, dtype, config)
        return plan
    if plan.device == "cuda" and plan.step == "Triton kernels":
        # the embeddings' tables, once (a tied head shares its blocks with one), before any repack
        tables = {_blocks_key(e): e for e in model.modules() if isinstance(e, quant.BlockEmbedding) and not e.planar}
        changed = False
        for c in plan.choices:
            changed |= _apply(c, plan, tables)
        if changed:
            plan = make(model, device, dtype, config)
    return plan


def _apply(c: Choice, plan: Plan, tables: dict) -> bool:
    m, cfg = c.site.module, plan.config
    if isinstance(m, hf_layers.GroupInt4Linear):
        if m.planar or not m.packed.is_cuda:
            return False
        m.to_planar(cfg.runs)  # (runs: kept as stored, in one allocation; else repacked as INT4P)
        return True
    if c.layout is None or not isinstance(m, quant.BlockLinear) or m.planar or not m.stored()[0].is_cuda:
        return False
    table = tables.get(_blocks_key(m))
    if not m.to_planar(cfg.runs, cfg.five_bit_runs):
        return False
    if table is not None:
        table.share_layout(m)
    if m.planar_fmt != c.layout:
        raise PlanError(f"{c.site.name}: repacked as {m.planar_fmt}, the plan said {c.layout}")
    return True

