"""`chat plan`: the kernel plan of a model (models/plan) as text. Op sites that agree in kind,
format, shape and kernel share a row; then the bytes a decode step reads, and the floor that a
memory bandwidth puts under a step's time (weights only, and with a context's KV cache).

    chat plan [MODEL] [--device cpu|cuda] [--dtype T] [--bandwidth GB/s] [setting flags]

On a host without CUDA, `--device cuda` loads on the CPU in the dtype a CUDA load would use and
plans as a CUDA host with Triton would (the floor then needs --bandwidth)."""
from __future__ import annotations

from collections import OrderedDict


def shape_text(site) -> str:
    d = site.dims
    if site.op == "attention":
        return f"{d['heads']} heads, {d['kv_heads']} KV, d {d['head_dim']}"
    if site.op == "gated_delta":
        return f"{d['heads']} heads, dk {d['dk']}, dv {d['dv']}"
    if site.op == "mamba2":
        return f"head {d['head_dim']}, state {d['state']}"
    if site.op == "short_conv":
        return "-"
    if site.op == "embedding":
        return f"{site.n} rows"
    if site.op == "experts":
        shape = f"{site.n}x{site.k}" if site.k else f"{site.n} rows"
        return f"{d['experts']} x {shape}, top {d['top_k']}"
    return f"{site.n}x{site.k}"


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB" if n >= 1e5 else f"{n / 1e3:,.1f} KB"


def rows(plan) -> list[dict]:
    """One row per (op, format, shape, kernel, layout), in the plan's op order, with its count,
    the bytes a decode step reads of them and the rule's reason."""
    from models.plan.sites import OPS
    groups: OrderedDict = OrderedDict()
    for c in sorted(plan.choices, key=lambda c: OPS.index(c.site.op)):
        fmt = c.site.source or c.site.fmt
        if c.layout and c.layout != fmt:
            fmt = f"{fmt} -> {c.layout}"
        key = (c.site.op, fmt, shape_text(c.site), c.kernel)
        row = groups.setdefault(key, {"op": key[0], "format": fmt, "shape": key[2], "kernel": c.kernel,
                                      "count": 0, "bytes": 0.0, "reason": c.reason})
        row["count"] += 1
        row["bytes"] += c.site.decode_bytes
    return list(groups.values())


def table_lines(plan) -> list[str]:
    head = {"op": "op", "format": "format", "shape": "shape", "count": "n", "kernel": "kernel",
            "bytes": "reads/step", "reason": "why"}
    body = [{**r, "count": str(r["count"]), "bytes": _mb(r["bytes"]) if r["bytes"] else "-"} for r in rows(plan)]
    cols = ["op", "format", "shape", "count", "kernel", "bytes"]
    width = {k: max(len(str(x[k])) for x in [head] + body) for k in cols}
    right = {"count", "bytes"}

    def line(r):
        cells = [str(r[k]).rjust(width[k]) if k in right else str(r[k]).ljust(width[k]) for k in cols]
        return "  ".join(cells) + "  " + r["reason"]
    return [line(head)] + [line(r) for r in body]


def floor_lines(plan, bandwidth: tuple[float, str] | None, context: int) -> list[str]:
    weights, kv = plan.decode_bytes(), plan.kv_bytes_per_token()
    out = [f"a decode step reads {_mb(weights)} of weights"
           + (f", plus {_mb(kv)} of KV cache per token of context ({_mb(kv * context)} at {context:,})" if kv else "")]
    if bandwidth is None:
        out.append("bandwidth floor: give --bandwidth GB/s (no such device here to read or measure)")
        return out
    bps, how = bandwidth
    for label, nbytes in (("weights only", weights), (f"at {context:,} tokens of context", weights + kv * context)):
        if label != "weights only" and not kv:
            continue
        seconds = nbytes / bps
        out.append(f"bandwidth floor ({label}): {seconds * 1e3:.3f} ms a token, at most {1 / seconds:,.0f} tok/s "
                   f"at {bps / 1e9:,.0f} GB/s ({how})")
    return out


def report(plan, title: str, bandwidth: tuple[float, str] | None, context: int) -> str:
    lines = [title, f"step: {plan.step}"]
    lines += [f"note: {n}" for n in plan.notes]
    lines += [""] + table_lines(plan) + [""] + floor_lines(plan, bandwidth, context)
    return "\n".join(lines)
