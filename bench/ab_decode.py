"""A/B of CUDA decode-step variants, interleaved in one process (drift between runs of several
percent would otherwise swamp the differences being measured).

    python bench/ab_decode.py NAME [NAME ...] [--variants base,nopdl,noprologue,prologue32]
        [--rounds 5] [--prompt 128] [--new 256]
For each shape: one model; each round builds a fresh graphed session per variant, in turn, and
times `--new` greedy tokens. Prints the median tok/s per variant, its ratio to the first, and
whether its tokens equal the first's. Variants: base (the defaults), normapart (Granite's norm before
the MLPs in its own launch, not in the router GEMV's prologue), nopipeline (the greedy
decode step by step: engine/session.py), nopdl (no programmatic dependent launch), noprologue
(every RMSNorm in its own launch), prologue1 (norms fused only into GEMVs of weights up to 1 MB:
an MoE router's), prologue4 / 8 / 16 (up to that many MB), prologue32 (norms fused into GEMVs
of weights up to 32 MB), prologueall (into every GEMV; the prologue variants set the bf16 GEMV's
bound only: fp8.py and qlinear.py import their own copy), notriton (the torch forms), wholek0 /
wholek32 (GEMVs of weights up to 0 / 32 MB read in one prefetched K step; since 2026-12-03 the
matrices of under 4,096 rows left out take linear.pick_config's long K steps, not steps of 128),
and wholek32 with the prologue variants. With --format Q4_K, Q5_K or
AWQ: noprefetch / prefetch (qplanar's GEMV loops without / with their read of the next step's
words, every layout), twolaunch (a norm's int8 input made in two launches, not
qplanar.normed_input's one), reduce256 / reduce128 (qplanar's split-K reduce over 256 / 128
outputs a program), nqp1 / nqp4 (qplanar.normed_input's launch in one program / about 4, not
about 8), a16 (qplanar's GEMVs on the bf16 inputs as given, not int8: qplanar.A16; other
tokens), programs2k / programs1 (qplanar.pick_config's K split aiming at ~2,048 programs / none),
nosmall (pick_config without its form for small matrices, qplanar.SMALL), grid1024 / grid512
(that form only below that many programs, qplanar.SMALL_GRID), qw* (qlinear.WHOLE_CONFIG: the
configs of matrices read in one step), tiny* (GGUF matrices up to 1 / 4 Mi weights left in their
blocks: KernelConfig.planar_min_weights; a model built per value, the same random weights), w2k (one
step up to 2,048 weights), wholeRxW (the one-step matrices on R rows and W warps a program,
the defaults' steps), tiny0 (every K-quant matrix repacked, one step up to 1,024 weights:
the defaults before R5), setq (tiny0, and the small-matrix forms without their bound on the
grid: every default as set Q left it). With --format FP8: fp8f32 (every FP8 GEMV in fp8.py's
fp32-product form: CHAT_FP8_GEMV=f32), fp8rows2 / fp8rows4 / fp8rows8 (its fp16-product form on
that many rows a program), fp8deep2..6 (that many rows a program where K passes 8,192:
fp8.DEEP_ROWS). planar4: Q4_K and AWQ linears in qplanar.py's layouts (Q4KP, INT4P: KernelConfig.runs
False), not qruns.py's runs; blocks5: GGUF Q5_0 / Q5_1 linears and a tied head of them in their
blocks (qlinear.py's GEMV: KernelConfig.five_bit_runs False), not as Q50R / Q51R runs; tiedruns /
tiedblocks: a tied head of a runs type repacked with its embedding reading it, or in its blocks
(KernelConfig.tied_runs True / False, the default); head8x1: a runs head's float path on 8 rows and 1
warp (qruns.HEAD_FLOAT's 16 rows before); runsBNxW / pairBNxW (qruns.py's single matrices / SwiGLU pairs on
BN rows and W warps a program), runsnp (qruns.py's picks without the read ahead), runsbefore
(its matrices of under 4,096 rows, no pair, on 2 rows and 2 warps as before 2026-12-03); rnqp1..32
(qruns.py's norm-and-quantize launch on about that many programs), rq4..32 (its quantize_input on
that many runs a program); head8x2 (a planar LM head's float path on 8 rows x 2 warps, not
qplanar.HEAD_FLOAT_TILE); pairbygate (the bf16 GEMV's SwiGLU pairs read in one K step where their
gate rows alone would be: linear.pick_config without `pair`); downk128 (the bf16 GEMV's rows too
long to read whole, under 4,096 of them, in K steps of 128 as before 2026-12-03), gemvbefore
(both). normwait / normend: the GEMV after a materialized norm launches once the norm has waited
on its predecessor / when the norm ends (linear.MATERIALIZE_LAUNCH). int8apart: the runs GEMVs'
int8 inputs each made in a launch of its own, not by the attention merge or the delta step before
them (qruns.FUSED_INT8 empty); pairon: the down's made by the SwiGLU pair's epilogue too;
mergeapart / deltaapart: o_proj's / out_proj's in a launch of its own (the same tokens in each;
set AM4's pairapart and mergeapart ran on 594865e, whose default had all three producers on).
Ablations (garbage values, so other tokens; the time a kernel takes inside the graphed step):
skipnorm (no add_rms_norm launch), skipquant / skipnq / skipint8 (no qruns.quantize_input launch
/ no qruns.normed_input launch / neither: the runs GEMVs read a stale int8 buffer), skipconv /
skipdeltastep / skipdelta (the Gated DeltaNet conv step, delta step, both). deltaone / delta{16,32,64}w{1,2,4,8}: the delta step in one program a head / split into
programs of that many value columns on that many warps (delta.SPLIT_CONFIG). r0: every Q4_K /
Q5_0 / Q5_1 matrix in runs, whatever its size (KernelConfig.runs_min_weights 0, the default since
2026-12-03); rmin4: the runs types' matrices of up to 4 Mi weights in their blocks.
(The fp8prefetch variant, of branch next-fp8-prefetch, the normcopy and late variants, the forms
before commits a509cd5 and c6bd2d3, and the selfN variants of the self-quantizing runs GEMV,
removed after set AL, are in bench/RESULTS.md.)
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from engine.config import SamplingConfig  # noqa: E402
from engine.session import DecodeSession  # noqa: E402
from models.architectures import granitemoehybrid, layers  # noqa: E402
from models import plan as kernel_plan  # noqa: E402
from models.kernels import switch, switches  # noqa: E402
from models.kernels.cuda import (base as cuda_base, delta as cuda_delta, fp8, linear as cuda_linear,  # noqa: E402
                                 qlinear, qplanar, qruns)
from shapes import random_model, random_quantized_model  # noqa: E402

KERNELS = kernel_plan.DEFAULT
DEFAULTS = dict(pipeline=DecodeSession.PIPELINE_GREEDY, pdl=switches()["pdl"],
                prologue=cuda_linear.PROLOGUE_MAX_BYTES, triton=switches()["triton"],
                wholek=cuda_linear.WHOLE_K_MAX_BYTES, prefetch=dict(qplanar.PREFETCH),
                normquant=qplanar.NORM_QUANTIZE, reduce=qplanar.REDUCE_BLOCK,
                nqp=qplanar.NORM_QUANTIZE_PROGRAMS, programs=qplanar.PROGRAMS, a16=False,
                small=qplanar.SMALL, small_grid=qplanar.SMALL_GRID,
                whole=qlinear.WHOLE_CONFIG, planar_min=KERNELS.planar_min_weights, five=KERNELS.five_bit_runs,
                tied=KERNELS.tied_runs, fusedscale=layers.FUSED_SCALE,
                sharedexperts=granitemoehybrid.SHARED_AS_EXPERTS, defernorm=granitemoehybrid.DEFER_MLP_NORM,
                fp8form=fp8.FORM, fp8rows=None, fp8deep=fp8.DEEP_ROWS,
                normlaunch=cuda_linear.MATERIALIZE_LAUNCH, skip=(), runs=KERNELS.runs, runspick=None,
                deltasplit=cuda_delta.SPLIT_CONFIG, headtile=qplanar.HEAD_FLOAT_TILE,
                runsnqp=qruns.NORM_QUANTIZE_PROGRAMS, runsq=qruns.QUANTIZE_RUNS, gemvpick=None,
                runs_min=KERNELS.runs_min_weights, fusedint8=qruns.FUSED_INT8)
_PICK16 = fp8.pick_config16
_GEMV_PICK = cuda_linear.pick_config
_RUNS_PICK = qruns.pick_config
_WHOLE_STEP = qlinear.whole_step


def _down_k128(config, K):
    """A bf16 GEMV config as before 2026-12-03: pick_config's long K steps (a step shorter than
    the row; a row read whole in one step keeps its config) back to steps of 128."""
    return (4, 128, 8) if config in ((4, 2048, 8), (2, 4096, 4)) and config[1] < K else config


VARIANTS = {
    "base": {},
    "nopdl": dict(pdl=False),
    "nopipeline": dict(pipeline=False),
    "apartscale": dict(fusedscale=False, sharedexperts=False),  # Granite's residual multiplier as torch's products
    "sharedapart": dict(sharedexperts=False),  # Granite's shared MLP as its own GEMVs
    "normapart": dict(defernorm=False),  # Granite's norm before the MLPs in its own launch
    "noprologue": dict(prologue=0),
    "prologue32": dict(prologue=32 << 20),
    "prologue1": dict(prologue=1 << 20),
    **{f"prologue{m}": dict(prologue=m << 20) for m in (4, 8, 16)},
    "notriton": dict(triton=False),
    "wholek0": dict(wholek=0),
    "wholek32": dict(wholek=32 << 20),
    "wholek32-noprologue": dict(wholek=32 << 20, prologue=0),
    "prologueall": dict(prologue=1 << 62),
    "wholek32-prologue32": dict(wholek=32 << 20, prologue=32 << 20),
    "noprefetch": dict(prefetch=dict.fromkeys(qplanar.PREFETCH, False)),
    "prefetch": dict(prefetch=dict.fromkeys(qplanar.PREFETCH, True)),
    "twolaunch": dict(normquant=False),
    "reduce256": dict(reduce=256),
    "reduce128": dict(reduce=128),
    "nqp1": dict(nqp=1),
    "nqp4": dict(nqp=4),
    "a16": dict(a16=True),
    "programs2k": dict(programs=2048),
    "programs1": dict(programs=1),
    "nosmall": dict(small=False),
    "grid1024": dict(small_grid=1024),
    "grid512": dict(small_grid=512),
    **{f"qw{r}x{w}{'' if whole else 's' + str(most)}": dict(whole=(r, w, most, whole))
       for r, w, most, whole in ((1, 1, 1024, True), (2, 1, 1024, True), (4, 2, 1024, True), (4, 4, 1024, True),
                                 (8, 4, 1024, True), (2, 2, 1024, False), (1, 1, 1024, False), (4, 4, 1024, False),
                                 (2, 2, 64, False), (4, 4, 256, False))},
    "tiny1m": dict(planar_min=1 << 20),
    "repackall": dict(planar_min=0),  # every GGUF matrix repacked, whatever its size (the one-step config kept)
    "fp8f32": dict(fp8form="f32"),  # FP8's GEMVs all in the fp32-product form (CHAT_FP8_GEMV=f32)
    **{f"fp8rows{b}": dict(fp8rows=b) for b in (2, 4, 8)},  # the fp16 form on b rows a program
    **{f"fp8deep{b}": dict(fp8deep=b) for b in (2, 3, 4, 5, 6)},  # b rows where K passes 8,192 (fp8.DEEP_ROWS)
    "planar4": dict(runs=False),  # Q4_K and AWQ in qplanar.py's layouts (Q4KP, INT4P), not qruns.py's runs
    # GGUF Q5_0 / Q5_1 linears (and a tied head with its embedding) in their blocks, qlinear.py's
    # GEMV, as before 2026-12-03 (KernelConfig.five_bit_runs False)
    "blocks5": dict(five=False),
    "r0": dict(runs_min=0),  # every Q4_K / Q5_0 / Q5_1 matrix in runs, whatever its size (KernelConfig.runs_min_weights 0)
    "rmin4": dict(runs_min=4 << 20),  # the runs types' matrices of up to 4 Mi weights in their blocks
    "tiedruns": dict(tied=True),  # a tied LM head of a runs type repacked, its embedding reading it (KernelConfig.tied_runs)
    "tiedblocks": dict(tied=False),  # (the default since 2026-12-03: both in their blocks)
    "head8x1": dict(runspick=("head", 8, 1, True)),  # a runs head's float path on 8 rows, 1 warp (before HEAD_FLOAT)
    # qruns.py's GEMVs other than SwiGLU pairs on BN rows and W warps (runsBNxW), the pairs alone
    # (pairBNxW), every pick without its read ahead (runsnp)
    **{f"runs{bn}x{w}": dict(runspick=("single", bn, w, True)) for bn in (1, 2, 4, 8) for w in (1, 2, 4)},
    **{f"pair{bn}x{w}": dict(runspick=("pair", bn, w, True)) for bn in (2, 4) for w in (1, 2)},
    "runsnp": dict(runspick=("all", 0, 0, False)),
    "runsbefore": dict(runspick=("before", 2, 2, True)),  # under 4,096 rows (no pair) 2 rows on 2 warps, as before 2026-12-03
    "head8x2": dict(headtile=(8, 2)),  # a planar LM head's float path on the general form's tile (qplanar.HEAD_FLOAT_TILE)
    # the bf16 GEMV's SwiGLU pairs read in one K step by their gate rows' bytes (as before 2026-12-03)
    "pairbygate": dict(gemvpick=lambda K, N, pair=False: _GEMV_PICK(K, N)),
    # rows too long to read whole, under 4,096 of them, in K steps of 128 (as before 2026-12-03)
    "downk128": dict(gemvpick=lambda K, N, pair=False: _down_k128(_GEMV_PICK(K, N, pair), K)),
    "gemvbefore": dict(gemvpick=lambda K, N, pair=False: _down_k128(_GEMV_PICK(K, N), K)),  # both of the above
    # qruns.py's norm-and-quantize launch on about p programs (rnqpP); its quantize_input on r runs a program (rqR)
    **{f"rnqp{p}": dict(runsnqp=p) for p in (1, 4, 16, 32)},
    **{f"rq{r}": dict(runsq=r) for r in (4, 16, 32)},
    "normwait": dict(normlaunch="wait"),  # the GEMV after a materialized norm launches once the norm has waited
    "normend": dict(normlaunch="end"),
    # the launches making the runs GEMVs' int8 inputs (qruns.FUSED_INT8, from the default's producers)
    "int8apart": dict(fusedint8=frozenset()),  # every one in a launch of its own
    "pairon": dict(fusedint8=DEFAULTS["fusedint8"] | {"pair"}),  # the down's by the SwiGLU pair's epilogue too
    "mergeapart": dict(fusedint8=DEFAULTS["fusedint8"] - {"merge"}),  # o_proj's in a launch of its own
    "deltaapart": dict(fusedint8=DEFAULTS["fusedint8"] - {"delta"}),  # out_proj's in a launch of its own
    # ablations, for the time a kernel takes inside the graphed step (other tokens: garbage values)
    "skipnorm": dict(skip=("norm",)),  # no add_rms_norm launch (the stream and the normed row unwritten)
    "skipquant": dict(skip=("quant",)),  # no qruns.quantize_input launch (the GEMV reads a stale buffer)
    "skipnq": dict(skip=("normquant",)),  # no qruns.normed_input launch (the stream and the int8 row unwritten)
    "skipint8": dict(skip=("quant", "normquant")),  # neither
    "skipconv": dict(skip=("conv",)),  # no Gated DeltaNet conv step (its delta step reads garbage)
    "skipdeltastep": dict(skip=("step",)),  # no Gated DeltaNet delta step (the conv step runs)
    "skipdelta": dict(skip=("conv", "step")),
    "deltaone": dict(deltasplit=(1 << 30, 8)),  # the delta step in one program a head
    **{f"delta{bv}w{w}": dict(deltasplit=(bv, w)) for bv in (16, 32, 64) for w in (1, 2, 4, 8)},
    "w2k": dict(whole=(2, 2, 2048, True)),
    "tiny0": dict(planar_min=0, whole=(2, 2, 1024, True)),
    "setq": dict(planar_min=0, whole=(2, 2, 1024, True), small_grid=1 << 62),
    **{f"tiny{m}m-w{w}k": dict(planar_min=m << 20, whole=(2, 2, w << 10, True)) for m in (1, 2, 4, 8, 12) for w in (2, 4, 8)},
    **{f"whole{r}x{w}": dict(whole=(r, w, 4096, True)) for r, w in ((2, 4), (2, 8), (4, 8), (1, 2), (1, 4), (4, 4))},
}


_ADD_RMS_NORM, _DELTA_LAUNCH = cuda_base.add_rms_norm, cuda_delta.launch
_RUNS_QUANTIZE, _RUNS_NORMED = qruns.quantize_input, qruns.normed_input
_STALE: dict = {}


def _stale_int8(x):
    """The skipquant / skipnq ablations' int8 input: a buffer of its size made once, no launch."""
    k = x.x.shape[-1] if isinstance(x, cuda_linear.NormedRow) else x.shape[-1]
    key = (k, x.device)
    if key not in _STALE:
        _STALE[key] = qruns.int8_words(k, x.device)
    return _STALE[key]


def _unnormed(x, y, weight, eps, sum_out=None, early="start", out_dtype=None):
    """The skipnorm ablation's add_rms_norm: no launch, its outputs unwritten."""
    return (sum_out if sum_out is not None else torch.empty_like(x)), torch.empty_like(x, dtype=out_dtype)


def _launch_without(kernels: set):
    """delta.py's launch for the skipconv / skipdeltastep ablations: those kernels not launched."""
    def launch(kernel, grid, *args, **kwargs):
        if kernel not in kernels:
            _DELTA_LAUNCH(kernel, grid, *args, **kwargs)
    return launch


def _runs_pick(which: str, bn: int, warps: int, ahead: bool):
    """qruns.pick_config for the runs* / pair* variants: (bn, warps, ahead) for the single matrices
    ("single") or the SwiGLU pairs ("pair"), the default pick elsewhere; "all": every default
    pick with the read ahead as `ahead`; "before": (bn, warps, ahead) for the single matrices of
    under 4,096 rows only."""
    def pick(n, k, swiglu=False, int8=True):
        base = _RUNS_PICK(n, k, swiglu, int8)
        if which == "head":  # an LM head's float path only
            return (bn, warps, ahead) if not int8 and n >= 16384 and not swiglu else base
        if which == "all":
            return base[:2] + (ahead,)
        if which == "before" and (swiglu or n >= 4096):
            return base
        if (which == "pair") != swiglu:
            return base
        w = warps
        while w > 1 and 32 * w > k // qruns.RUN:
            w //= 2
        return bn, w, ahead
    return pick


def kernel_config(changes: dict) -> "kernel_plan.KernelConfig":
    """The KernelConfig of a variant: its load-time layout fields (planar_min, runs, five, tied,
    runs_min) over the defaults; a planar_min alone moves runs_min with it (the tiny* and
    repackall variants: the runs types too)."""
    v = {**DEFAULTS, **changes}
    if "planar_min" in changes and "runs_min" not in changes:
        v["runs_min"] = v["planar_min"]
    return KERNELS.but(planar_min_weights=v["planar_min"], runs=v["runs"], five_bit_runs=v["five"],
                       tied_runs=v["tied"], runs_min_weights=v["runs_min"])


def apply(variant: str) -> None:
    v = {**DEFAULTS, **VARIANTS[variant]}
    cuda_linear.MATERIALIZE_LAUNCH, cuda_delta.SPLIT_CONFIG = v["normlaunch"], v["deltasplit"]
    cuda_base.add_rms_norm = _unnormed if "norm" in v["skip"] else _ADD_RMS_NORM
    skipped = {k for p, k in (("conv", cuda_delta._conv_step_kernel), ("step", cuda_delta._delta_step_kernel))
               if p in v["skip"]}
    cuda_delta.launch = _launch_without(skipped) if skipped else _DELTA_LAUNCH
    qruns.FUSED_INT8 = v["fusedint8"]
    qruns.quantize_input = _stale_int8 if "quant" in v["skip"] else _RUNS_QUANTIZE
    qruns.normed_input = _stale_int8 if "normquant" in v["skip"] else _RUNS_NORMED
    DecodeSession.PIPELINE_GREEDY = v["pipeline"]
    switch(pdl=v["pdl"], triton=v["triton"])
    cuda_linear.PROLOGUE_MAX_BYTES = v["prologue"]
    cuda_linear.WHOLE_K_MAX_BYTES, qplanar.PREFETCH, qplanar.NORM_QUANTIZE = v["wholek"], v["prefetch"], v["normquant"]
    qplanar.REDUCE_BLOCK, qplanar.HEAD_FLOAT_TILE = v["reduce"], v["headtile"]
    qruns.NORM_QUANTIZE_PROGRAMS, qruns.QUANTIZE_RUNS = v["runsnqp"], v["runsq"]
    qplanar.NORM_QUANTIZE_PROGRAMS, qplanar.PROGRAMS, qplanar.SMALL = v["nqp"], v["programs"], v["small"]
    qplanar.SMALL_GRID, qlinear.WHOLE_CONFIG = v["small_grid"], v["whole"]
    # the qw*s variants (not read in one step): steps of their own size, as set R measured them
    # (qlinear.whole_step picks the one-step widths only for matrices read whole)
    qlinear.whole_step = _WHOLE_STEP if v["whole"][3] else (lambda fmt, k, swiglu=False, most=v["whole"][2]: most)
    layers.FUSED_SCALE, granitemoehybrid.SHARED_AS_EXPERTS = v["fusedscale"], v["sharedexperts"]
    granitemoehybrid.DEFER_MLP_NORM = v["defernorm"]
    fp8.FORM, fp8.DEEP_ROWS = v["fp8form"], v["fp8deep"]
    fp8.pick_config16 = _PICK16 if v["fp8rows"] is None else (
        lambda n, k, swiglu=False, b=v["fp8rows"]: (b,) + _PICK16(n, k, swiglu)[1:])
    qruns.pick_config = _RUNS_PICK if v["runspick"] is None else _runs_pick(*v["runspick"])
    cuda_linear.pick_config = v["gemvpick"] or _GEMV_PICK
    qplanar.A16 = v["a16"]


def main() -> None:
    from engine.device import configure_process
    configure_process()  # (the environment's diagnosis switches and folders, as chat takes them)
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="+")
    ap.add_argument("--variants", default="base,nopdl,noprologue,prologue32")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--format", default="bf16", help="bf16, or Q4_K / Q5_K / AWQ / FP8 (random weights in that format, "
                    "repacked as the loader leaves them on CUDA)")
    a = ap.parse_args()
    dev = torch.device("cuda")
    variants = a.variants.split(",")
    for name in a.names:
        built = {}

        def build(v: str):
            apply(v)
            kernels = kernel_config(VARIANTS.get(v, {}))  # (the plan is bound when a model is built: one a config)
            key = kernels if a.format != "bf16" else 0  # (bf16: one model)
            if key not in built:
                if a.format == "bf16":
                    built[key] = random_model(name, dev, torch.bfloat16)
                else:
                    built[key] = random_quantized_model(name, a.format, dev, torch.bfloat16)
                    kernel_plan.bind(built[key], dev, torch.bfloat16, kernels)
            return built[key]

        model = build("base")
        g = torch.Generator().manual_seed(1)
        prompt = torch.randint(0, model.config.vocab_size, (a.prompt,), generator=g).tolist()
        cfg = SamplingConfig(temperature=0, max_new_tokens=a.new)
        speeds = {v: [] for v in variants}
        tokens = {}
        for _ in range(a.rounds):
            for v in variants:
                s = DecodeSession(build(v), max_context=a.prompt + a.new + 8, device=dev, dtype=torch.bfloat16,
                                  cuda_graph="on")
                list(s.generate(prompt, SamplingConfig(temperature=0, max_new_tokens=16), stop_ids=()))
                s.reset()
                tokens[v] = list(s.generate(prompt, cfg, stop_ids=()))
                st = s.last_stats
                speeds[v].append((st.generated_tokens - 1) / st.decode_seconds)
                del s
        apply("base")
        first = variants[0]
        base = statistics.median(speeds[first])
        for v in variants:
            med = statistics.median(speeds[v])
            print(f"{name:14} {v:11} {med:8.1f} tok/s  {med / base:5.3f}x  (min {min(speeds[v]):.1f}, "
                  f"max {max(speeds[v]):.1f})  tokens {'=' if tokens[v] == tokens[first] else '!='} {first}",
                  flush=True)
        del model
        built.clear()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
