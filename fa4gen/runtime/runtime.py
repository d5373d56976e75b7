"""Load and launch a generated cubin through the CUDA driver API (cuda-python), on torch tensors.

`Kernel.load(cubin, manifest)` loads the module once and reads the device's SM count and L2 size;
`kernel(q, k, v, o, lse=None, softmax_scale=s)` encodes the four tensor maps the manifest describes
(docs/ABI.md) from the tensors' pointers and strides, derives the causal scheduler's L2 section
size (fa4gen/spec/schedule.py) and launches on torch's current stream. Inputs are assumed validated by the caller
(fa4gen.runtime.api): contiguous last dim, 16-byte aligned pointers and strides, dtype matching the kernel.

Every CUresult is checked; a failure raises CudaError naming the call and the driver's message.
torch and cuda-python are imported lazily so the generator runs without them.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from typing import NamedTuple

from ..spec.encodings import TmaL2Promotion, swizzle_from_name
from ..spec.schedule import L2Choice, choose_l2_group, varlen_l2_rows

__all__ = ["CudaError", "Kernel", "RuntimeSetupError", "tensor_map_geometry"]

# docs/ABI.md's parameters (fa4gen.spec.plan.ABI_PARAMS); the manifest's "params" gives their order.
from ..spec.plan import ABI_PARAM_NAMES as _PARAM_NAMES  # noqa: E402
from ..spec.plan import TMA_L2_PROMOTIONS, tma_l2_promotion  # noqa: E402


class CudaError(RuntimeError):
    """A CUDA driver call failed: `.call` is the function, `.code` the CUresult name."""

    def __init__(self, call: str, code, message: str):
        self.call = call
        self.code = code
        super().__init__(f"{call} failed: {code} ({message})")


class RuntimeSetupError(RuntimeError):
    """The manifest and the tensors do not fit together (a caller or generator bug, not a CUDA error)."""


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise RuntimeSetupError("cuda-python (cuda-bindings) is required to launch kernels: pip install cuda-bindings") from e
    return driver


def _check(call: str, result):
    """Unpack a cuda-python result tuple, raising CudaError on anything but CUDA_SUCCESS."""
    drv = _driver()
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != drv.CUresult.CUDA_SUCCESS:
        e2, msg = drv.cuGetErrorString(err)
        text = msg.decode() if e2 == drv.CUresult.CUDA_SUCCESS and msg else "no message"
        raise CudaError(call, getattr(err, "name", str(err)), text)
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: an id, padding to 8, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


def driver_l2_promotions(drv) -> dict[str, int]:
    """The manifest's L2 promotion labels (encodings.TmaL2Promotion, the one list of them) -> the
    driver's CUtensorMapL2promotion values, by the enum's names (cuda.bindings.driver as `drv`)."""
    return {mode.label: int(getattr(drv.CUtensorMapL2promotion, f"CU_TENSOR_MAP_L2_PROMOTION_{mode.name}"))
            for mode in TmaL2Promotion}


class _Libcuda:
    """The two driver calls of every launch, through ctypes on libcuda (the library cuda-python binds):
    cuTensorMapEncodeTiled and cuLaunchKernel on one packed parameter buffer. cuda-python builds a
    Python object per argument (tens of microseconds a launch); these take integers and a buffer.
    Module loading and the rest stay on cuda-python."""

    def __init__(self):
        drv = _driver()
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:  # pragma: no cover - cuda-python found the driver, so this one is there
            raise RuntimeSetupError(f"cannot open the CUDA driver library libcuda.so.1: {e}") from e
        vp, u32, i32 = ctypes.c_void_p, ctypes.c_uint, ctypes.c_int
        # no argtypes: their conversion costs a microsecond a launch; `launch` passes the handles as
        # c_void_p and the dimensions as ints (C int and unsigned int share a register)
        self._launch = lib.cuLaunchKernel
        self._launch.restype = i32
        # cuLaunchKernelEx: a programmatic dependent launch (plan.COMBINE_PROGRAMMATIC); None on a
        # driver without it (the launch is then an ordinary one, which the kernels also run under)
        self._launch_ex = getattr(lib, "cuLaunchKernelEx", None)
        if self._launch_ex is not None:
            self._launch_ex.argtypes = [ctypes.POINTER(_LaunchConfig), vp, vp, vp]
            self._launch_ex.restype = i32
        self._programmatic = int(drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
        self._memset = lib.cuMemsetD32Async  # the dynamic deal's counter, zeroed in the launch's stream
        self._memset.argtypes = [ctypes.c_uint64, u32, ctypes.c_size_t, vp]
        self._memset.restype = i32
        self._encode = lib.cuTensorMapEncodeTiled
        self._encode.argtypes = [vp, i32, u32, vp, vp, vp, vp, vp, i32, i32, i32, i32]
        self._encode.restype = i32
        self._err_name, self._err_string = lib.cuGetErrorName, lib.cuGetErrorString
        for f in (self._err_name, self._err_string):
            f.argtypes, f.restype = [i32, ctypes.POINTER(ctypes.c_char_p)], i32
        # the enum values as cuda-python defines them (one source for both bindings)
        self.dtypes = {"bf16": int(drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16),
                       "fp16": int(drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16)}
        self.swizzles = {"128B": int(drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B),
                         "64B": int(drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_64B),
                         "none": int(drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE)}
        self.promotions = driver_l2_promotions(drv)
        self._fixed = (int(drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE),
                       int(drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE))

    def _raise(self, call: str, err: int):
        name, text = ctypes.c_char_p(), ctypes.c_char_p()
        self._err_name(err, ctypes.byref(name))
        self._err_string(err, ctypes.byref(text))
        raise CudaError(call, name.value.decode() if name.value else str(err),
                        text.value.decode() if text.value else "no message")

    def encode_tiled(self, spec: "MapSpec", addr: int) -> bytes:
        """The 128-byte CUtensorMap of one tensor (encoded into a 64-byte-aligned scratch buffer)."""
        role, geo = spec.role, spec.geo
        rank = len(geo.dims)
        buf = ctypes.create_string_buffer(128 + 64)
        at = ctypes.addressof(buf) + (-ctypes.addressof(buf) % 64)
        err = self._encode(at, self.dtypes[spec.dtype], rank, addr, (ctypes.c_uint64 * rank)(*geo.dims),
                           (ctypes.c_uint64 * max(rank - 1, 1))(*geo.strides), (ctypes.c_uint32 * rank)(*geo.box),
                           (ctypes.c_uint32 * rank)(*([1] * rank)), self._fixed[0], self.swizzles[spec.swizzle],
                           self.promotions[spec.l2_promotion], self._fixed[1])
        if err:
            self._raise(f"cuTensorMapEncodeTiled({role})", err)
        return ctypes.string_at(at, 128)

    def zero_words(self, ptr: int, n: int, stream: int) -> None:
        """cuMemsetD32Async: n 32-bit words at ptr set to 0, in stream's order (captured by a CUDA graph)."""
        err = self._memset(ptr, 0, n, stream)
        if err:
            self._raise("cuMemsetD32Async(task_counter)", err)

    def launch(self, call: str, function: ctypes.c_void_p, grid: int, threads: int, smem: int, stream: int,
               argv: ctypes.c_void_p, programmatic: bool = False) -> None:
        """cuLaunchKernel with kernelParams = argv (a void* per parameter, in signature order); with
        programmatic, cuLaunchKernelEx with programmatic stream serialisation allowed (the kernel may
        start before the previous one in the stream ends: it waits with griddepcontrol.wait)."""
        if not (0 < grid < 2 ** 31 and 0 < threads <= 1024 and 0 <= smem < 2 ** 31):
            raise RuntimeSetupError(f"{call}: grid {grid}, {threads} threads, {smem} bytes of shared memory")
        if programmatic and self._launch_ex is not None:
            attr = _LaunchAttribute(id=self._programmatic, value=1)
            cfg = _LaunchConfig(grid, 1, 1, threads, 1, 1, smem, stream, ctypes.pointer(attr), 1)
            err = self._launch_ex(ctypes.byref(cfg), function, argv, None)
        else:
            err = self._launch(function, grid, 1, 1, threads, 1, 1, smem, ctypes.c_void_p(stream), argv, None)
        if err:
            self._raise(call, err)


_LIBCUDA: list = []


def _libcuda() -> _Libcuda:
    if not _LIBCUDA:
        _LIBCUDA.append(_Libcuda())
    return _LIBCUDA[0]


def _stream(device: int) -> int:
    """torch's current stream on `device`, as the driver's handle."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(device) if raw is not None else torch.cuda.current_stream(device).cuda_stream


class _Entry:
    """One kernel entry's launch: its parameters packed into one buffer in the ABI's layout
    (plan.param_buffer_layout), cuLaunchKernel given a pointer to each. The buffer and the pointer
    array are made once; a lock keeps two threads from packing into them at once (the driver copies
    the parameters before cuLaunchKernel returns)."""

    def __init__(self, name: str, function, params: tuple, decls: dict, programmatic: bool = False):
        # function: a CUfunction (or None); programmatic: launched with programmatic stream serialisation
        import struct
        import threading

        from ..spec.plan import param_buffer_layout

        self.name = name
        self.params = params
        self.programmatic = programmatic
        self.handle = int(function) if function is not None else 0
        self._function = ctypes.c_void_p(self.handle)
        self._call = f"cuLaunchKernel({name})"
        fmt, offsets = param_buffer_layout([decls[p] for p in params])
        self.struct = struct.Struct(fmt)
        self._buf = ctypes.create_string_buffer(self.struct.size + 64)
        self._at = (-ctypes.addressof(self._buf)) % 64  # the buffer starts 64-byte aligned, like .param space
        base = ctypes.addressof(self._buf) + self._at
        self._argv = (ctypes.c_void_p * max(len(params), 1))(*(base + off for off in offsets))
        self._argv_ptr = ctypes.c_void_p(ctypes.addressof(self._argv))
        self._lock = threading.Lock()

    def values(self, named: dict) -> list:
        """The parameters' values in signature order (RuntimeSetupError naming any the call lacks)."""
        try:
            return [named[p] for p in self.params]
        except KeyError as e:
            raise RuntimeSetupError(f"{self.name}: no value for parameter {e.args[0]!r}") from None

    def launch_values(self, vals: list, grid: int, threads: int, smem: int, device: int) -> None:
        """Launch with the parameters' values in signature order on torch's current stream of `device`."""
        stream = _stream(device)
        lib = _libcuda()
        with self._lock:
            self.struct.pack_into(self._buf, self._at, *vals)
            lib.launch(self._call, self._function, grid, threads, smem, stream, self._argv_ptr, self.programmatic)


_MAP_PLACEHOLDER = bytes(128)


def out_ptrs(ptrs: dict, o, lse) -> dict:
    """ptrs with a launch's outputs' pointers added (O's map and row pointer, the LSE's or 0)."""
    ptrs["tmap_o"] = ptrs["o_ptr"] = o.data_ptr()
    ptrs["lse_ptr"] = 0 if lse is None else lse.data_ptr()
    return ptrs


def dense_ptrs(q, k, v, sink) -> dict:
    """The per-call pointers of a dense launch but its outputs' (Kernel.DENSE_PER_CALL)."""
    return {"tmap_q": q.data_ptr(), "tmap_k": k.data_ptr(), "tmap_v": v.data_ptr(),
            "sink_ptr": 0 if sink is None else sink.data_ptr()}


def varlen_ptrs(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, sink) -> dict:
    """The per-call pointers of a varlen launch but its outputs' (Kernel.VARLEN_PER_CALL)."""
    return {**dense_ptrs(q, k, v, sink), "cu_seqlens_q": cu_seqlens_q.data_ptr(),
            "cu_seqlens_k": cu_seqlens_k.data_ptr(), "seqused_k": 0 if seqused_k is None else seqused_k.data_ptr()}


def kvcache_ptrs(q, k_cache, v_cache, cache_seqlens, page_table, sink) -> dict:
    """The per-call pointers of a KV-cache launch but its outputs' and partials' (Kernel.KVCACHE_PER_CALL)."""
    return {**dense_ptrs(q, k_cache, v_cache, sink), "cache_seqlens": cache_seqlens.data_ptr(),
            "page_table": 0 if page_table is None else page_table.data_ptr()}


class Bound:
    """One entry's launch with every parameter its call's metadata decides already in place (shapes,
    strides, scale, modifiers, grid): a call gives only the parameters that change from call to call
    (data pointers; a tensor map as its tensor's pointer, encoded once per pointer).

    `per_call` names those parameters: `run(values)` takes a dict of them, a tensor map's under its
    parameter name (tmap_q, ...) as the pointer of the tensor it maps. `Kernel.bind`, `bind_varlen`
    and `bind_kvcache` make one from tensors; the Kernel's launch methods and the API's per-signature
    fast path (fa4gen.runtime.launch) run them."""

    __slots__ = ("entry", "grid", "threads", "smem", "device", "torch_device", "dynamic", "_vals", "_slots", "_maps")

    def __init__(self, entry: _Entry, named: dict, per_call: tuple[str, ...], maps: dict, grid: int, threads: int,
                 smem: int, device):  # device: the torch.device of the call's tensors
        self.entry, self.grid, self.threads, self.smem = entry, grid, threads, smem
        self.torch_device, self.device = device, device.index
        # a zeroed counter of its own per launch: the index of its parameter, or -1
        self.dynamic = entry.params.index("task_counter") if "task_counter" in entry.params else -1
        fill = {n: (_MAP_PLACEHOLDER if n in maps else 0) for n in per_call}
        self._vals = entry.values({**named, **fill, "task_counter": 0})
        # (index, name, the map's MapSpec or None) per per-call parameter it has
        self._slots = tuple((i, p, maps.get(p)) for i, p in enumerate(entry.params) if p in fill)
        self._maps: dict = {}

    def _map(self, name: str, spec, ptr: int) -> bytes:
        hit = self._maps.get((name, ptr))
        if hit is None:
            hit = _libcuda().encode_tiled(spec, ptr)
            if len(self._maps) >= 64:
                self._maps.clear()
            self._maps[(name, ptr)] = hit
        return hit

    def run(self, values: dict) -> None:
        vals = self._vals.copy()
        for i, name, spec in self._slots:
            vals[i] = values[name] if spec is None else self._map(name, spec, values[name])
        if self.dynamic >= 0:
            # the dynamic deal's counter (plan.DYNAMIC_ABI_PARAMS): a word of this launch alone, from
            # torch's allocator on the launch's stream (stream-ordered: no later work reuses it early;
            # under CUDA-graph capture, the graph's private pool), zeroed in that stream by one driver
            # memset (a capture records it with the launch); torch.zeros would add a fill kernel's dispatch
            import torch

            counter = torch.empty(1, dtype=torch.int32, device=self.torch_device)
            _libcuda().zero_words(counter.data_ptr(), 1, _stream(self.device))
            vals[self.dynamic] = counter.data_ptr()
        self.entry.launch_values(vals, self.grid, self.threads, self.smem, self.device)


@dataclass(frozen=True)
class MapGeometry:
    dims: tuple[int, ...]  # elements, innermost first
    strides: tuple[int, ...]  # bytes, for dims[1:]
    box: tuple[int, ...]


class MapSpec(NamedTuple):
    """One tensor map as cuTensorMapEncodeTiled takes it: the manifest's static fields and the call's geometry."""
    role: str
    dtype: str
    swizzle: str
    l2_promotion: str  # one of plan.TMA_L2_PROMOTIONS
    geo: MapGeometry


def map_l2_promotion(role: str, spec: dict, kvcache: bool) -> str:
    """The L2 promotion of a manifest tensor map of a KV-cache kernel or another: what plan.tma_l2_promotion
    wrote into it, or, in a manifest written before the field existed (whose maps were all encoded at
    256B), what the rule gives today."""
    value = spec.get("l2_promotion") or tma_l2_promotion(kvcache)
    if value not in TMA_L2_PROMOTIONS:
        raise RuntimeSetupError(f"{role}: the manifest's l2_promotion {value!r} is not one of {', '.join(TMA_L2_PROMOTIONS)}")
    return value


def manifest_gqa(manifest: dict) -> tuple[int, int]:
    """(GQA ratio G, heads per Q tile P) of a built kernel: the manifest's "gqa" record (the rule
    is fa4gen.spec.tiles.gqa_pack); a manifest written before the record existed packed P = G."""
    ratio = int(manifest["config"]["gqa_ratio"])
    rec = manifest.get("gqa")
    pack = int(rec["pack"]) if rec else ratio
    if pack < 1 or ratio % pack:
        raise RuntimeSetupError(f"the manifest packs {pack} heads per tile for GQA ratio {ratio}: not a divisor")
    return ratio, pack


def manifest_tile_rows(manifest: dict) -> int:
    """Rows of the kernel's Q tile (its config's block_m: 128, or 192 for sm_90a's three-consumer tiles)."""
    rows = int(manifest["config"].get("block_m") or 128)
    if rows not in (128, 192):
        raise RuntimeSetupError(f"the manifest's Q tile has {rows} rows: this runtime knows 128 and 192")
    return rows


def manifest_block_n(manifest: dict) -> int:
    """Keys per K/V block of the kernel (its config's block_n, plan.block_n: 128, or 64 for sm_90a D = 256)."""
    from ..spec.tiles import ROWS, SM90_KV_BLOCK

    n, known = int(manifest["config"].get("block_n") or ROWS), sorted({ROWS, *SM90_KV_BLOCK.values()})
    if n not in known:
        raise RuntimeSetupError(f"the manifest's K/V blocks have {n} keys: this runtime knows {known}")
    return n


@dataclass(frozen=True)
class LaunchGeometry:
    """What one launch covers: (batch, head group) pairs x m_blocks of block_m / pack positions."""
    pack: int  # query heads per Q tile
    head_groups: int  # tiles side by side in the head dimension per kv head (G / pack)
    rows_per_tile: int  # sequence positions per Q tile (block_m / pack)
    num_m_blocks: int
    num_bh: int  # batch * Hkv * head_groups: the pairs the scheduler orders
    num_tasks: int  # in Q tiles (the kernel clamps it to its own task unit)


def launch_geometry(manifest: dict, batch: int, num_heads_kv: int, seqlen_q: int) -> LaunchGeometry:
    ratio, pack = manifest_gqa(manifest)
    rows = manifest_tile_rows(manifest) // pack
    nmb = -(-int(seqlen_q) // rows)
    num_bh = int(batch) * int(num_heads_kv) * (ratio // pack)
    return LaunchGeometry(pack, ratio // pack, rows, nmb, num_bh, num_bh * nmb)


def varlen_num_tasks(manifest: dict, batch: int, num_heads_kv: int, total_q: int) -> int:
    """The num_tasks bound a varlen launch passes (fa4gen.spec.plan.varlen_task_bound): every real task
    of any cu_seqlens with these B and total_q is below it; the kernel stops at its own count."""
    from ..spec.plan import varlen_task_bound

    ratio, pack = manifest_gqa(manifest)
    unit = int(manifest["grid"].get("tiles_per_task", 1)) * (manifest_tile_rows(manifest) // pack)
    return varlen_task_bound(batch, total_q, int(num_heads_kv) * (ratio // pack), unit)


def tensor_map_geometry(role: str, spec: dict, shape: tuple[int, ...], strides: tuple[int, ...],
                        elem_bytes: int, pack: int) -> MapGeometry:
    """Global dims/strides of one tensor map from a [B, S, H, D] tensor (strides in elements).

    Q and O use a 5-D view of the head axis (stride sH) split into the `pack` heads of one Q
    tile (stride sH) and H / pack head groups (stride pack * sH): (D, G, Hkv, Sq, B) when the tile
    packs the whole GQA group (pack = G), (D, P, Hg, Sq, B) otherwise (fa4gen.spec.tiles.gqa_pack).
    K and V use (D, Hkv, Skv, B).
    """
    B, S, H, D = shape
    sB, sS, sH, sD = strides
    if sD != 1:
        raise RuntimeSetupError(f"{role}: the head dim must be contiguous (stride 1), got stride {sD}")
    by_name = {
        "D": (D, 1), "B": (B, sB), "Sq": (S, sS), "Skv": (S, sS),
        "Pages": (B, sB), "Page": (S, sS),  # a paged KV cache (num_pages, page_size, Hkv, D)
    }
    if "G" in spec["dims"] or "P" in spec["dims"]:
        if H % pack:
            raise RuntimeSetupError(f"{role}: {H} heads is not a multiple of the {pack} heads per Q tile")
        inner, outer = ("G", "Hkv") if "G" in spec["dims"] else ("P", "Hg")
        by_name[inner] = (pack, sH)
        by_name[outer] = (H // pack, pack * sH)
    else:
        by_name["Hkv"] = (H, sH)
    try:
        dims = tuple(by_name[n][0] for n in spec["dims"])
        estr = tuple(by_name[n][1] for n in spec["dims"])
    except KeyError as e:
        raise RuntimeSetupError(f"{role}: the manifest names an unknown tensor-map dim {e.args[0]!r}") from None
    box = tuple(int(b) for b in spec["box"])
    if len(box) != len(dims):
        raise RuntimeSetupError(f"{role}: box {box} and dims {spec['dims']} differ in rank")
    span = swizzle_from_name(spec.get("swizzle", "none")).span_bytes
    if span and box[0] * elem_bytes > span:
        raise RuntimeSetupError(f"{role}: a {spec['swizzle']}-swizzled box is at most {span} bytes wide, "
                                f"got {box[0] * elem_bytes}")
    return MapGeometry(dims=dims, strides=tuple(s * elem_bytes for s in estr[1:]), box=box)


_SCORE_MOD_FLAGS = ("window", "softcap", "sinks")


def score_mod_scalars(config: dict, softmax_scale: float, mods=None, sink=None) -> dict:
    """`scale_log2` and the score modifiers' parameters (plan.WINDOW/SOFTCAP/SINKS_ABI_PARAMS) of one
    launch of the kernel whose manifest config is `config`, by parameter name (Python numbers; the
    parameter buffer rounds the f32 ones once).

    mods: the call's validate.ScoreMods (None: none); sink: its float32 contiguous learnable_sink
    (anything with data_ptr()). A windowed kernel runs any window (unbounded sides pass
    plan.WINDOW_UNBOUNDED; a causal kernel's right side is 0); a softcap kernel needs softcap > 0 and
    a sinks kernel a sink tensor (each always applies them); a call needing a flag its kernel lacks
    is refused: a windowed call never runs a kernel without the window. Softcap: softcap_in =
    softmax_scale / softcap and scale_log2 = softcap * log2(e) (the kernel takes tanh of the raw
    score times softcap_in; docs/ABI.md "Windows, softcap, sinks")."""
    from ..spec.plan import kernel_score_scalars, kernel_window_args

    have = {f: bool(config.get(f, False)) for f in _SCORE_MOD_FLAGS}
    left = right = None
    cap = 0.0
    if mods is not None:
        left, right, cap = mods.window_left, mods.window_right, mods.softcap
        need = dict(mods.flags)
        missing = [f for f in _SCORE_MOD_FLAGS if need[f] and not have[f]]
        if missing:
            has = [f for f in _SCORE_MOD_FLAGS if have[f]]
            raise RuntimeSetupError(f"the call needs a kernel with {', '.join(missing)}; this kernel has "
                                    f"{', '.join(has) if has else 'no score modifier'} (fa4gen build --window / "
                                    f"--softcap / --sinks make one)")
    if have["softcap"] and not cap > 0:
        raise RuntimeSetupError("a softcap kernel always caps: call it with softcap > 0")
    if have["sinks"] and sink is None:
        raise RuntimeSetupError("a sinks kernel reads a learnable_sink: call it with one (float32, one per query head)")
    if sink is not None and not have["sinks"]:
        raise RuntimeSetupError("a learnable_sink was given to a kernel without sinks")
    out = kernel_score_scalars(softmax_scale, cap if have["softcap"] else 0.0)
    if have["window"]:
        out.update(kernel_window_args((-1 if left is None else left, -1 if right is None else right),
                                      bool(config.get("causal"))))
    out["sink_ptr"] = 0 if sink is None else sink.data_ptr()
    return out


_MISS = object()


def _memoised(cache: dict, key, limit: int, compute):
    """cache[key], computed once (None included); a cache past `limit` entries starts over (shapes seen
    by one process are few, but nothing bounds them)."""
    hit = cache.get(key, _MISS)
    if hit is _MISS:
        hit = compute()
        if len(cache) > limit:
            cache.clear()
        cache[key] = hit
    return hit


class Kernel:
    """One loaded fa4_fwd kernel. Construct with `Kernel.load(cubin, manifest)`."""

    def __init__(self, module, function, manifest: dict, sm_count: int, device: int, l2_bytes: int = 0,
                 combine=None):
        self._module = module
        self._function = function
        self._combine = combine  # the KV-cache module's fa4_combine entry (None otherwise)
        self.manifest = manifest
        self.sm_count = sm_count
        self.l2_bytes = l2_bytes
        self.device = device
        self._cfg = manifest["config"]
        self.block_n = manifest_block_n(manifest)
        self._bound_cache: dict = {}  # call shape -> Bound (or None: nothing to launch)
        self._l2_cache: dict = {}
        params = tuple(manifest["params"])
        unknown = [p for p in params if p not in _PARAM_NAMES]
        if unknown:
            raise RuntimeSetupError(f"the manifest names kernel parameters this runtime cannot pass: {unknown}")
        from ..spec.plan import SINKS_ABI_PARAMS, SOFTCAP_ABI_PARAMS, WINDOW_ABI_PARAMS

        for flag, names in (("window", WINDOW_ABI_PARAMS), ("softcap", SOFTCAP_ABI_PARAMS), ("sinks", SINKS_ABI_PARAMS)):
            takes = [n for n, _ in names if n in params]
            if (len(takes) == len(names)) != bool(self._cfg.get(flag, False)) or 0 < len(takes) < len(names):
                raise RuntimeSetupError(f"the manifest's config says {flag}={bool(self._cfg.get(flag, False))} but its "
                                        f"parameters {'lack' if self._cfg.get(flag) else 'have'} {[n for n, _ in names]}")
        self._params = params
        from ..spec.plan import ALL_ABI_DECLS, COMBINE_ABI_DECLS

        self._entry = _Entry(manifest.get("entry", "fa4_fwd"), function, params, ALL_ABI_DECLS)
        self._combine_entry = None
        if "kvcache" in manifest:
            rec = manifest["kvcache"]["combine"]
            unknown = [p for p in rec["params"] if p not in COMBINE_ABI_DECLS]
            if unknown:
                raise RuntimeSetupError(f"the manifest's combine entry names parameters this runtime cannot pass: "
                                        f"{unknown}")
            self._combine_entry = _Entry(rec["entry"], combine, tuple(rec["params"]), COMBINE_ABI_DECLS,
                                         programmatic=bool(rec.get("programmatic", False)))

    # ---- loading -------------------------------------------------------------------------------
    @classmethod
    def load(cls, cubin: bytes, manifest: dict) -> "Kernel":
        import torch

        drv = _driver()
        if not torch.cuda.is_available():
            raise RuntimeSetupError("no CUDA device visible to torch")
        device = torch.cuda.current_device()
        torch.cuda.init()
        torch.empty(1, device="cuda")  # make torch's primary context current on this thread
        _check("cuInit", drv.cuInit(0))
        ctx = _check("cuCtxGetCurrent", drv.cuCtxGetCurrent())
        if ctx is None or int(ctx) == 0:
            dev = _check("cuDeviceGet", drv.cuDeviceGet(device))
            ctx = _check("cuDevicePrimaryCtxRetain", drv.cuDevicePrimaryCtxRetain(dev))
            _check("cuCtxSetCurrent", drv.cuCtxSetCurrent(ctx))
        module = _check("cuModuleLoadData", drv.cuModuleLoadData(bytes(cubin)))
        entry = manifest.get("entry", "fa4_fwd")
        function = _check(f"cuModuleGetFunction({entry})", drv.cuModuleGetFunction(module, entry.encode()))
        smem = int(manifest["dynamic_smem_bytes"])
        _check("cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)", drv.cuFuncSetAttribute(
            function, drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem))
        dev = _check("cuDeviceGet", drv.cuDeviceGet(device))
        sm_count = _check("cuDeviceGetAttribute(MULTIPROCESSOR_COUNT)", drv.cuDeviceGetAttribute(
            drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev))
        l2_bytes = _check("cuDeviceGetAttribute(L2_CACHE_SIZE)", drv.cuDeviceGetAttribute(
            drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, dev))
        combine = None
        if "kvcache" in manifest:
            centry = manifest["kvcache"]["combine"]["entry"]
            combine = _check(f"cuModuleGetFunction({centry})", drv.cuModuleGetFunction(module, centry.encode()))
        return cls(module, function, manifest, int(sm_count), device, int(l2_bytes), combine)

    # ---- launching -----------------------------------------------------------------------------
    def _map_spec(self, role: str, shape: tuple, strides: tuple, elem_bytes: int) -> "MapSpec":
        """What a Bound encodes role's tensor map from."""
        spec = self.manifest["tensor_maps"][role]
        geo = tensor_map_geometry(role, spec, tuple(shape), tuple(strides), elem_bytes, manifest_gqa(self.manifest)[1])
        return MapSpec(role, spec["dtype"], spec["swizzle"], map_l2_promotion(role, spec, "kvcache" in self.manifest), geo)

    def _maps(self, tensors) -> dict:
        """{tmap_<role>: its map spec} of (role, tensor) pairs in [B, S, H, D]."""
        return {f"tmap_{r}": self._map_spec(r, t.shape, t.stride(), t.element_size()) for r, t in tensors}

    def _check_device(self, q) -> None:
        if q.device.index != self.device:
            raise RuntimeSetupError(f"kernel was loaded on cuda:{self.device}, tensors are on {q.device}: "
                                    "load one Kernel per device")

    def _check_gqa(self, Hq: int, Hkv: int) -> None:
        G = int(self._cfg["gqa_ratio"])
        if Hq != Hkv * G:
            raise RuntimeSetupError(f"Hq={Hq} is not Hkv={Hkv} x the kernel's GQA ratio {G}")

    def _bound(self, key, make):
        """The Bound (or None: nothing to launch) of a call shape, made once per key."""
        return _memoised(self._bound_cache, key, 256, make)

    def _main_bound(self, named: dict, per_call: tuple, maps: dict, num_tasks: int, device) -> Bound:
        return Bound(self._entry, named, per_call, maps, self.grid(num_tasks), int(self.manifest["threads_per_cta"]),
                     int(self.manifest["dynamic_smem_bytes"]), device)

    def _geometry(self, batch: int, num_heads_kv: int, seqlen_q: int) -> LaunchGeometry:
        return _memoised(self._l2_cache, ("geometry", batch, num_heads_kv, seqlen_q), 256,
                         lambda: launch_geometry(self.manifest, batch, num_heads_kv, seqlen_q))

    def grid(self, num_tasks: int) -> int:
        policy = self.manifest["grid"]["policy"]
        if policy == "persistent":
            return min(num_tasks, self.sm_count)
        if policy == "one_per_task":
            return num_tasks
        raise RuntimeSetupError(f"unknown grid policy {policy!r} in the manifest")

    def l2_group(self, batch: int, num_heads_kv: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                 elem_bytes: int) -> L2Choice:
        """The `l2_group` launch parameter for this problem on this device (fa4gen/spec/schedule.py),
        memoised per shape: the persistent grid's choice evaluates the deal's balance."""
        def choose():
            geo = self._geometry(batch, num_heads_kv, seqlen_q)
            per_task = int(self.manifest["grid"].get("tiles_per_task", 1))
            m_count = -(-geo.num_m_blocks // per_task)
            # the scheduler's pairs are (batch, head group): head_groups of them per kv head
            return choose_l2_group(
                causal=bool(self._cfg["causal"]), persistent=self.manifest["grid"]["policy"] == "persistent",
                l2_bytes=self.l2_bytes, batch=batch, num_heads_kv=num_heads_kv * geo.head_groups, seqlen_q=seqlen_q,
                seqlen_k=seqlen_k, head_dim=head_dim, elem_bytes=elem_bytes, m_count=m_count,
                nctas=max(self.grid(geo.num_tasks), 1), seq_q_per_tile=geo.rows_per_tile,
                tiles_per_task=per_task, block_n=self.block_n, dynamic="task_counter" in self.manifest["params"])
        return _memoised(self._l2_cache, (batch, num_heads_kv, seqlen_q, seqlen_k, head_dim, elem_bytes), 256, choose)

    DENSE_PER_CALL = ("tmap_q", "tmap_k", "tmap_v", "tmap_o", "lse_ptr", "o_ptr", "sink_ptr")
    VARLEN_PER_CALL = DENSE_PER_CALL + ("cu_seqlens_q", "cu_seqlens_k", "seqused_k")
    KVCACHE_PER_CALL = DENSE_PER_CALL + ("cache_seqlens", "page_table", "o_partial", "lse_partial")
    COMBINE_PER_CALL = ("o_partial", "lse_partial", "o_ptr", "lse_ptr", "sink_ptr")

    def bind_varlen(self, q, k, v, o, cu_seqlens_q, max_seqlen_q: int, max_seqlen_k: int, lse=None, seqused_k=None,
                    softmax_scale: float | None = None, mods=None, sink=None) -> Bound | None:
        """The Bound of a varlen launch (`varlen`'s arguments; per call: VARLEN_PER_CALL), None when
        there is nothing to launch."""
        if "varlen" not in self.manifest:
            raise RuntimeSetupError(f"{self.manifest['name']} is not a varlen kernel")
        self._check_device(q)
        key = ("varlen", q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), o.shape, o.stride(),
               q.element_size(), int(cu_seqlens_q.shape[0]), max_seqlen_q, max_seqlen_k, lse is None,
               seqused_k is None, softmax_scale, mods, sink is None)

        def make():
            Tq, Hq, D = q.shape
            Tk, Hkv = k.shape[0], k.shape[1]
            B = int(cu_seqlens_q.shape[0]) - 1
            self._check_gqa(Hq, Hkv)
            scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
            num_tasks = varlen_num_tasks(self.manifest, B, Hkv, Tq)
            if num_tasks == 0:
                return None
            # the packed tensors seen as a batch of one (docs/ABI.md "Varlen"): what unsqueeze(0) gives
            maps = {f"tmap_{r}": self._map_spec(r, (1, *t.shape), (t.shape[0] * t.stride(0), *t.stride()),
                                                t.element_size())
                    for r, t in (("q", q), ("k", k), ("v", v), ("o", o))}
            named = {
                "batch": B, "seqlen_q": max_seqlen_q,
                "seqlen_k": max_seqlen_k, "num_heads_kv": Hkv,
                "num_m_blocks": 0, "num_tasks": num_tasks,
                "l2_group": varlen_l2_rows(self.l2_bytes, D, q.element_size()),
                "total_q": Tq, "total_k": Tk,
                **score_mod_scalars(self._cfg, scale, mods, sink),
            }
            return self._main_bound(named, self.VARLEN_PER_CALL, maps, num_tasks, q.device)
        return self._bound(key, make)

    def varlen(self, q, k, v, o, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, lse=None,
               seqused_k=None, softmax_scale: float | None = None, mods=None, sink=None) -> None:
        """Launch a varlen kernel (manifest "varlen") on torch's current stream: q, o (total_q, Hq, D),
        k, v (total_k, Hkv, D), cu_seqlens int32 (B + 1,), seqused_k int32 (B,) or None, lse
        (Hq, total_q) fp32 or None. Validated by the caller (fa4gen.runtime.api.attention_varlen); the
        kernel clamps every offset into the packed tensors."""
        b = self.bind_varlen(q, k, v, o, cu_seqlens_q, max_seqlen_q, max_seqlen_k, lse, seqused_k, softmax_scale, mods,
                             sink)
        if b is not None:
            b.run(out_ptrs(varlen_ptrs(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, sink), o, lse))

    def kvcache_num_splits(self, batch: int, num_heads_kv: int, seqlen_q: int, kv_len: int) -> int:
        """num_splits = 0's choice (fa4gen.spec.schedule.choose_num_splits) for this device's SM count:
        kv_len is the longest sequence's keys when the caller knows it, else the cache capacity."""
        from ..spec.plan import KVCACHE_MAX_SPLITS
        from ..spec.schedule import choose_num_splits

        return _memoised(self._l2_cache, ("splits", batch, num_heads_kv, seqlen_q, kv_len), 256,
                         lambda: choose_num_splits(self._geometry(batch, num_heads_kv, seqlen_q).num_tasks,
                                                   -(-int(kv_len) // self.block_n), self.sm_count, KVCACHE_MAX_SPLITS))

    def bind_kvcache(self, q, k_cache, v_cache, o, page_table=None, num_splits: int = 1, lse=None,
                     softmax_scale: float | None = None, mods=None, sink=None) -> tuple[Bound, Bound | None] | None:
        """The Bounds of a KV-cache launch (`kvcache`'s arguments; per call: KVCACHE_PER_CALL) and, for
        num_splits > 1, of its combine (COMBINE_PER_CALL); None when there is nothing to launch."""
        rec = self.manifest.get("kvcache")
        if rec is None:
            raise RuntimeSetupError(f"{self.manifest['name']} is not a KV-cache kernel")
        self._check_device(q)
        key = ("kvcache", q.shape, q.stride(), k_cache.shape, k_cache.stride(), v_cache.shape, v_cache.stride(),
               o.shape, o.stride(), q.element_size(), None if page_table is None else (page_table.shape, page_table.stride()),
               int(num_splits), lse is None, softmax_scale, mods, sink is None)

        def make():
            paged = int(rec["page_size"]) > 0
            if paged != (page_table is not None):
                raise RuntimeSetupError(f"{self.manifest['name']} " + ("needs a page_table" if paged else
                                                                       "is for a contiguous cache: no page_table"))
            B, Sq, Hq, D = q.shape
            Hkv = k_cache.shape[2]
            self._check_gqa(Hq, Hkv)
            if not o.is_contiguous():
                raise RuntimeSetupError("a KV-cache kernel stores O (B, Sq, Hq, D) by row offsets: o must be "
                                        "contiguous")
            S = int(num_splits)
            if S < 1:
                raise RuntimeSetupError(f"num_splits={S}: must be >= 1")
            scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
            geo = self._geometry(B, Hkv, Sq)
            num_tasks = geo.num_tasks * S
            if num_tasks == 0:
                return None
            if paged:
                num_pages, page_size = int(k_cache.shape[0]), int(k_cache.shape[1])
                max_pages, stride = int(page_table.shape[1]), int(page_table.stride(0))
                capacity = max_pages * page_size
            else:
                num_pages = max_pages = stride = 0
                capacity = int(k_cache.shape[1])
            named = {
                "batch": B, "seqlen_q": Sq, "seqlen_k": capacity,
                "num_heads_kv": Hkv,
                "num_m_blocks": geo.num_m_blocks, "num_tasks": num_tasks,
                "l2_group": 1,
                "page_table_stride": stride, "max_pages": max_pages,
                "num_pages": num_pages, "num_splits": S,
                **score_mod_scalars(self._cfg, scale, mods, sink),
            }
            maps = self._maps((("q", q), ("k", k_cache), ("v", v_cache), ("o", o)))
            main = self._main_bound(named, self.KVCACHE_PER_CALL, maps, num_tasks, q.device)
            if S == 1:
                return main, None
            rows = B * Sq * Hq
            cr = rec["combine"]
            # sink_ptr is read only if the combine entry declares it (sinks)
            combine = Bound(self._combine_entry, {"rows": rows, "num_splits": S, "seqlen_q": Sq, "num_heads_q": Hq},
                            self.COMBINE_PER_CALL, {}, -(-rows // int(cr["rows_per_cta"])), int(cr["threads_per_cta"]),
                            0, q.device)
            return main, combine
        return self._bound(key, make)

    def kvcache(self, q, k_cache, v_cache, o, cache_seqlens, page_table=None, num_splits: int = 1, lse=None,
                softmax_scale: float | None = None, o_partial=None, lse_partial=None, mods=None, sink=None) -> None:
        """Launch a KV-cache kernel (manifest "kvcache") and, for num_splits > 1, its combine kernel,
        on torch's current stream. q, o (B, Sq, Hq, D); k_cache, v_cache (B, Smax, Hkv, D), or
        (num_pages, page_size, Hkv, D) with page_table (B, max_pages) int32 for a paged kernel;
        cache_seqlens int32 (B,); lse (B, Hq, Sq) fp32 or None; o_partial fp32 (S, B*Sq*Hq, D) and
        lse_partial fp32 (S, B*Sq*Hq) when num_splits > 1. Validated by the caller
        (fa4gen.runtime.api.attention_with_kvcache); the kernel clamps lengths and page entries."""
        if int(num_splits) > 1 and (o_partial is None or lse_partial is None):
            raise RuntimeSetupError("num_splits > 1 needs o_partial and lse_partial")
        bounds = self.bind_kvcache(q, k_cache, v_cache, o, page_table, num_splits, lse, softmax_scale, mods, sink)
        if bounds is None:
            return
        ptrs = out_ptrs(kvcache_ptrs(q, k_cache, v_cache, cache_seqlens, page_table, sink), o, lse)
        ptrs["o_partial"] = 0 if o_partial is None else o_partial.data_ptr()
        ptrs["lse_partial"] = 0 if lse_partial is None else lse_partial.data_ptr()
        run_kvcache(bounds, ptrs)

    def bind(self, q, k, v, o, lse=None, softmax_scale: float | None = None, l2_group: int | None = None, mods=None,
             sink=None) -> Bound | None:
        """The Bound of a dense launch (`__call__`'s arguments; per call: DENSE_PER_CALL), None when
        there is nothing to launch."""
        if "varlen" in self.manifest:
            raise RuntimeSetupError(f"{self.manifest['name']} is a varlen kernel: launch it with Kernel.varlen")
        if "kvcache" in self.manifest:
            raise RuntimeSetupError(f"{self.manifest['name']} is a KV-cache kernel: launch it with Kernel.kvcache")
        self._check_device(q)
        key = ("dense", q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), o.shape, o.stride(),
               q.element_size(), lse is None, softmax_scale, l2_group, mods, sink is None)

        def make():
            B, Sq, Hq, D = q.shape
            Skv, Hkv = k.shape[1], k.shape[2]
            self._check_gqa(Hq, Hkv)
            o_ptr = "o_ptr" in self.manifest["params"]  # O stored from the registers (plan.DENSE_O_ABI_PARAMS)
            if o_ptr and not o.is_contiguous():
                raise RuntimeSetupError(f"{self.manifest['name']} stores O (B, Sq, Hq, DV) by row offsets: o must be "
                                        "contiguous")
            scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
            geo = self._geometry(B, Hkv, Sq)
            if geo.num_tasks == 0:
                return None
            group = self.l2_group(B, Hkv, Sq, Skv, D, q.element_size()).l2_group if l2_group is None else l2_group
            named = {
                "batch": B, "seqlen_q": Sq, "seqlen_k": Skv,
                "num_heads_kv": Hkv,
                "num_m_blocks": geo.num_m_blocks, "num_tasks": geo.num_tasks,
                "l2_group": max(min(int(group), 0xFFFFFFFF), 0),
                **score_mod_scalars(self._cfg, scale, mods, sink),
            }
            maps = self._maps((("q", q), ("k", k), ("v", v), ("o", o)))
            return self._main_bound(named, self.DENSE_PER_CALL, maps, geo.num_tasks, q.device)
        return self._bound(key, make)

    def __call__(self, q, k, v, o, lse=None, softmax_scale: float | None = None, l2_group: int | None = None,
                 mods=None, sink=None) -> None:
        """Launch on torch's current stream. `l2_group` overrides the L2 section size the runtime
        derives from the device's L2 (any value is safe: the kernel clamps it to [1, B*Hkv])."""
        b = self.bind(q, k, v, o, lse, softmax_scale, l2_group, mods, sink)
        if b is not None:
            b.run(out_ptrs(dense_ptrs(q, k, v, sink), o, lse))


def run_kvcache(bounds: tuple, ptrs: dict) -> None:
    """Run a KV-cache launch's Bounds (Kernel.bind_kvcache): the kernel, then its combine when split."""
    main, combine = bounds
    main.run(ptrs)
    if combine is not None:
        combine.run(ptrs)
