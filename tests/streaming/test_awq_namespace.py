"""The store namespace of an int4 model names the bits its kernel computes: the avx512_bf16 path's int4
numerics are its own, and so are the amx_bf16 path's, so K/V stored by a host on such a path never serve a host
(or a process) on another."""

from __future__ import annotations

import torch

from kvboost_hf import kernels
from kvboost_hf.models.namespace import namespace
from tests.streaming.conftest import load_awq


def test_the_namespace_names_the_int4_numerics_version_the_library_was_built_with(tiny_awq, monkeypatch):
    """v1 (each weight decoded, one fma chain over K) and v2 (scale and zero once per group) differ in their
    bits: K/V stored by a process on a library of v1's sources are never served to one on v2's."""
    assert kernels.available().built
    assert torch.ops.kvboost.int4_numerics_version() == 2
    ours = load_awq(tiny_awq["gemma3"][1], residency_mode="full_resident", kernel="kvboost", dtype=torch.bfloat16)
    kernels.select_isa("avx2" if kernels.available().host_isa != "scalar" else "scalar")
    try:
        v2 = namespace(ours)
        monkeypatch.setattr(kernels, "int4_numerics", lambda: "kvboost-int4-fma-v1")  # as a v1 library says
        assert namespace(ours) != v2
    finally:
        kernels.select_isa(None)


def test_the_namespace_follows_the_int4_numerics_of_the_isa_path(tiny_awq):
    status = kernels.available()
    assert status.built, status.reason
    path = tiny_awq["gemma3"][1]
    ours = load_awq(path, residency_mode="full_resident", kernel="kvboost", dtype=torch.bfloat16)
    theirs = load_awq(path, residency_mode="full_resident", kernel="torch", dtype=torch.bfloat16)
    paths = kernels.ISA_LEVELS[: kernels.ISA_LEVELS.index(status.host_isa) + 1]
    keys, numerics = {}, {}
    try:
        for isa in paths:
            kernels.select_isa(isa)
            keys[isa] = (namespace(ours), namespace(theirs))
            numerics[isa] = kernels.int4_numerics()
    finally:
        kernels.select_isa(None)
    own = {"avx512_bf16": "kvboost-int4-bf16dot-v1", "amx_bf16": "kvboost-int4-amx-v1-"}  # bits of their own
    fma = {keys[isa][0] for isa in paths if isa not in own}
    assert len(fma) == 1  # scalar, avx2 and avx512 compute the same bits: one namespace
    assert {numerics[isa] for isa in paths if isa not in own} == {"kvboost-int4-fma-v2"}
    for isa in own.keys() & keys.keys():
        assert keys[isa][0] not in fma and numerics[isa].startswith(own[isa]), isa
    if "amx_bf16" in keys:  # named by how this CPU's tiles round: a fixed probe's bits, hashed
        fingerprint = torch.ops.kvboost.amx_fingerprint()
        assert fingerprint > 0 and numerics["amx_bf16"] == f"kvboost-int4-amx-v1-{fingerprint:016x}"
    if own.keys() <= keys.keys():
        assert keys["avx512_bf16"][0] != keys["amx_bf16"][0]
    assert len({key for _, key in keys.values()}) == 1  # torch's kernel: its namespace as before
    assert all(key not in fma for _, key in keys.values())  # and never one of ours
