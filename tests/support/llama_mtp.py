"""llama.cpp's MTP drafts on a GGUF, as the reference tests/families/qwen3_5/test_mtp.py compares ours with.

    PYTHON-WITH-llama_cpp tests/support/llama_mtp.py FILE.gguf '{"prompt": [...], "draft": K}'

Run by a Python that has llama-cpp-python 0.3.36 (a reference, never a dependency: the test
skips where none is given). Through its library's C API and the staging calls its speculative
decoding uses (src/llama-ext.h: llama_set_embeddings_nextn / llama_get_embeddings_nextn_ith,
C++ symbols, called by their mangled names), as common/speculative.cpp's draft-mtp does it:
the target decodes the prompt, its final-normed rows ("h_nextn") kept; an MTP context over the
same weights decodes each prompt token at its position with the target's row of the position
before (zeros at position 0); then the drafts chain from the last row, each the greedy token of
the MTP logits, fed at the next position with the MTP's own normed row. Prints one JSON line:
the target's rows, the MTP logits of every prompt row, the drafts.
"""
from __future__ import annotations

import ctypes
import json
import os
import sys

import numpy as np


def main() -> None:
    import llama_cpp as L

    path, args = sys.argv[1], json.loads(sys.argv[2])
    prompt, k = args["prompt"], args["draft"]
    lib = L.llama_cpp._lib
    set_nextn = lib["_Z26llama_set_embeddings_nextnP13llama_contextbb"]
    set_nextn.argtypes, set_nextn.restype = [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool], None
    nextn_ith = lib["_Z30llama_get_embeddings_nextn_ithP13llama_contexti"]
    nextn_ith.argtypes, nextn_ith.restype = [ctypes.c_void_p, ctypes.c_int32], ctypes.POINTER(ctypes.c_float)

    class Embd(ctypes.Structure):  # (struct llama_embd, where the bindings lack it)
        _fields_ = [("data", ctypes.POINTER(ctypes.c_float)), ("n_rows", ctypes.c_size_t), ("n_embd", ctypes.c_size_t)]
    Embd = getattr(L, "llama_embd", Embd)

    for name, argtypes, restype in (
            ("llama_batch_ext_init", [ctypes.c_void_p], ctypes.c_void_p),
            ("llama_batch_ext_free", [ctypes.c_void_p], None),
            ("llama_batch_ext_clear", [ctypes.c_void_p], None),
            ("llama_batch_ext_add_token", [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32], ctypes.c_int32),
            ("llama_batch_ext_set_pos", [ctypes.c_void_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32)], ctypes.c_bool),
            ("llama_batch_ext_set_embd_token", [ctypes.c_void_p, ctypes.c_int32, Embd], ctypes.c_bool),
            ("llama_batch_ext_set_output_logits", [ctypes.c_void_p, ctypes.c_int32, ctypes.c_bool], ctypes.c_bool),
            ("llama_process", [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p], ctypes.c_int32)):
        f = lib[name]
        f.argtypes, f.restype = argtypes, restype

    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.load_mtp = True
    model = L.llama_model_load_from_file(path.encode(), mp)
    if not model:
        raise SystemExit(f"llama.cpp could not load {path}")
    n_embd, n_vocab = L.llama_model_n_embd(model), L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))

    def context(mtp: bool):
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_threads, cp.n_threads_batch = 256, 256, 256, 1, 1
        if mtp:
            cp.ctx_type = L.LLAMA_CONTEXT_TYPE_MTP
        ctx = L.llama_init_from_model(model, cp)
        set_nextn(ctx, True, mtp)  # the target: every row's h; the MTP context: the output rows'
        return ctx

    def process(ctx, rows: list[tuple[int, int, np.ndarray | None]], outputs: bool):
        """Feed (token, position, embd or None) rows; returns the batch."""
        b = lib.llama_batch_ext_init(ctx)
        keep = []
        for token, pos, h in rows:
            idx = lib.llama_batch_ext_add_token(b, 0, token)
            lib.llama_batch_ext_set_pos(b, idx, ctypes.byref(ctypes.c_int32(pos)))
            if h is not None:
                arr = np.ascontiguousarray(h, dtype=np.float32)
                keep.append(arr)
                lib.llama_batch_ext_set_embd_token(b, idx, Embd(arr.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, n_embd))
            if outputs:
                lib.llama_batch_ext_set_output_logits(b, idx, True)
        rc = lib.llama_process(ctx, 1, b)  # LLAMA_PROCESS_TYPE_DECODE
        lib.llama_batch_ext_free(b)
        if rc != 0:
            raise SystemExit(f"llama_process failed ({rc})")

    def row(ptr) -> np.ndarray:
        return np.ctypeslib.as_array(ptr, shape=(n_embd,)).copy()

    def logits(ctx, i) -> np.ndarray:
        return np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).copy()

    tgt, dft = context(False), context(True)
    process(tgt, [(t, p, None) for p, t in enumerate(prompt)], True)
    h = np.stack([row(nextn_ith(tgt, i)) for i in range(len(prompt))])
    next_token = int(np.argmax(logits(tgt, len(prompt) - 1)))
    shifted = [np.zeros(n_embd, np.float32)] + list(h[:-1])
    process(dft, [(t, p, shifted[p]) for p, t in enumerate(prompt)], True)
    mtp_logits = np.stack([logits(dft, i) for i in range(len(prompt))])
    # the drafts after the target's next token, at the prompt's length
    drafts, pos, hid, tok = [], len(prompt), h[-1], next_token
    for _ in range(k):
        process(dft, [(tok, pos, hid)], True)
        tok = int(np.argmax(logits(dft, 0)))
        drafts.append(tok)
        hid, pos = row(nextn_ith(dft, 0)), pos + 1
    print(json.dumps({"hidden": h.tolist(), "mtp_logits": mtp_logits.tolist(), "next": next_token,
                      "drafts": drafts}))
    sys.stdout.flush()
    os._exit(0)  # (llama.cpp's teardown is not what is tested)


if __name__ == "__main__":
    main()
