"""KV-cache layouts, defined once.

Everything that needs to know where a byte of KV lives (the page allocator, the
view builders, the Triton kernels' tests, the benchmarks) takes it from here.

Units. A *block* is ``block_size`` tokens of one layer and one of K/V:
``block_bytes = block_size * num_kv_heads * head_size * itemsize``. A *page* is
``page_size`` bytes of one layer and one of K/V (``KVCACHED_PAGE_SIZE_MB``), so it
holds ``blocks_per_page = page_size // block_bytes`` blocks; a block size that
does not divide the page is an error, so no block ever straddles two pages.
The allocator hands out *page indices*: page ``p`` holds blocks
``[p * blocks_per_page, (p + 1) * blocks_per_page)`` of **every** layer and of
both K and V, so one page index is ``num_layers * kv_factor * page_size`` bytes of
physical memory (one physical allocation, sliced across the regions below).

Layouts (``kv`` is 0 for K, 1 for V; ``N`` the padded number of blocks):

* ``CONTIGUOUS`` -- one virtual tensor laid out ``[N, num_layers, kv_factor, block]``:
  all layers of a block sit side by side, so page ``p`` is one contiguous range
  and costs one map call. Layer ``l``'s K tensor is a strided view whose block
  stride is ``num_layers * kv_factor`` blocks.
* ``PER_LAYER`` -- one virtual tensor per layer laid out ``[kv_factor, N, block]``
  (K half, then V half): each layer's K and V are dense, which is what vendor
  kernels that ignore strides expect. Page ``p`` is ``num_layers * kv_factor``
  ranges of ``page_size`` bytes.

Token-major placement (SGLang). Engines that address *tokens* (SGLang keeps
per-token K and V buffers ``[num_tokens, H, D]`` per layer and groups them into
"pages" of ``P`` tokens) need one token stride everywhere. They use the geometry of
one-token blocks (:func:`token_major_geometry`): on the contiguous layout that is
``[tokens, num_layers, kv_factor, H, D]`` (one token of every layer's K and V side
by side; token stride ``num_layers * kv_factor`` tokens), on the per-layer layout it
is the per-layer layout itself. An engine page of ``P`` tokens is ``P`` consecutive
token slots, and the allocator still hands out blocks of ``P`` tokens: as ``P``
divides the tokens of one page, page ``p`` holds exactly engine pages
``[p * ppp, (p + 1) * ppp)`` with ``ppp = page_size // (P * token_bytes)``, the
same bytes in both geometries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import Enum

import torch

from kvcached.errors import KVCachedConfigError

# Engines name their view shapes; these are the ones we build.
FLASH_ATTN = "flash_attn"  # vLLM FlashAttention/Triton style: (2, N, block_size, H, D)
FLASHINFER = "flashinfer"  # FlashInfer style: (N, 2, block_size, H, D)
VIEW_STYLES = (FLASH_ATTN, FLASHINFER)
# SGLang's per-token buffers [tokens, H, D] seen as pages (N // P, P, H, D): token-major on the contiguous layout
SGLANG_PAGED = "sglang"

SUPPORTED_DTYPES = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float8_e4m3fn,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2,
    torch.uint8,
    torch.int8,
)


class Layout(str, Enum):
    CONTIGUOUS = "contiguous"
    PER_LAYER = "per_layer"

    @classmethod
    def parse(cls, value: Layout | str | bool) -> Layout:
        """Accept a Layout, its name, or the kvcached-style ``contiguous: bool``."""
        if isinstance(value, Layout):
            return value
        if isinstance(value, bool):
            return cls.CONTIGUOUS if value else cls.PER_LAYER
        try:
            return cls(str(value).lower().replace("-", "_"))
        except ValueError:
            raise KVCachedConfigError(
                f"unknown KV layout {value!r}; use 'contiguous' or 'per_layer'."
            ) from None


@dataclass(frozen=True)
class KVSpec:
    """What the engine asks for: model geometry and how many blocks (virtually)."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    kv_factor: int = 2  # 2: K and V; 1: a single latent (MLA) or K-only cache

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise KVCachedConfigError(f"{name} must be a positive int, got {value!r}.")
        if isinstance(self.kv_factor, bool) or self.kv_factor not in (1, 2):
            raise KVCachedConfigError(f"kv_factor must be 1 or 2, got {self.kv_factor!r}.")
        if self.dtype not in SUPPORTED_DTYPES:
            names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
            raise KVCachedConfigError(f"KV dtype {self.dtype} is not supported; use one of {names}.")

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def block_elems(self) -> int:
        return self.block_size * self.num_kv_heads * self.head_size

    @property
    def block_bytes(self) -> int:
        return self.block_elems * self.itemsize


@dataclass(frozen=True)
class Region:
    """Where page index ``p`` lands in one virtual tensor: ``[base + p*size, +size)``."""

    tensor: int
    base: int
    size: int


@dataclass(frozen=True)
class LayerStrides:
    """Layer ``l``'s K (kv=0) / V (kv=1) blocks, in elements of the KV dtype.

    Element ``(block n, kv k, i)`` of layer ``l`` is at
    ``offset + n * block_stride + k * kv_stride + i`` of tensor ``tensor``.
    """

    tensor: int
    offset: int
    block_stride: int
    kv_stride: int


@dataclass(frozen=True)
class KVGeometry:
    spec: KVSpec
    layout: Layout
    page_size: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", Layout.parse(self.layout))
        bb = self.spec.block_bytes
        if self.page_size <= 0 or self.page_size % (2 << 20):
            raise KVCachedConfigError(
                f"page size {self.page_size} B is not a positive multiple of 2 MiB."
            )
        if bb > self.page_size or self.page_size % bb:
            raise KVCachedConfigError(
                f"a KV block of {bb} B (block_size={self.spec.block_size} x "
                f"{self.spec.num_kv_heads} heads x {self.spec.head_size} x "
                f"{self.spec.itemsize} B) does not divide the {self.page_size >> 20} MiB page, "
                "so blocks would straddle pages; pick a power-of-two block size or head "
                "size, or set KVCACHED_PAGE_SIZE_MB to a multiple of the block size."
            )

    # -- sizes -------------------------------------------------------------
    @property
    def blocks_per_page(self) -> int:
        return self.page_size // self.spec.block_bytes

    @property
    def num_pages(self) -> int:
        return math.ceil(self.spec.num_blocks / self.blocks_per_page)

    @property
    def num_blocks(self) -> int:
        """Blocks addressable after rounding up to whole pages."""
        return self.num_pages * self.blocks_per_page

    @property
    def page_group_bytes(self) -> int:
        """Physical bytes behind one page index (all layers, K and V)."""
        return self.spec.num_layers * self.spec.kv_factor * self.page_size

    @property
    def num_tensors(self) -> int:
        return 1 if self.layout is Layout.CONTIGUOUS else self.spec.num_layers

    @property
    def tensor_bytes(self) -> int:
        """Virtual size of each virtual tensor."""
        return self.num_pages * self.page_group_bytes // self.num_tensors

    @property
    def unit_bytes(self) -> int:
        """Size of one mapped range in a tensor (the zero page is mapped at this grain)."""
        return self.regions()[0].size

    # -- where things are --------------------------------------------------
    def regions(self) -> list[Region]:
        """Ranges that page index ``p`` maps, in the order the physical page is sliced."""
        s, ps = self.spec, self.page_size
        if self.layout is Layout.CONTIGUOUS:
            return [Region(0, 0, self.page_group_bytes)]
        half = self.num_pages * ps
        return [Region(layer, k * half, ps) for layer in range(s.num_layers) for k in range(s.kv_factor)]

    def layer_strides(self, layer: int) -> LayerStrides:
        s = self.spec
        if not 0 <= layer < s.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {s.num_layers}).")
        e = s.block_elems
        if self.layout is Layout.CONTIGUOUS:
            return LayerStrides(0, layer * s.kv_factor * e, s.num_layers * s.kv_factor * e, e)
        return LayerStrides(layer, 0, e, self.num_blocks * e)

    def page_of_block(self, block: int) -> int:
        return block // self.blocks_per_page

    def block_byte_offset(self, layer: int, kv: int, block: int) -> tuple[int, int]:
        """(tensor index, byte offset) of the first byte of one block."""
        st = self.layer_strides(layer)
        elems = st.offset + block * st.block_stride + kv * st.kv_stride
        return st.tensor, elems * self.spec.itemsize


# -- views -----------------------------------------------------------------
def _typed(base: torch.Tensor, geom: KVGeometry) -> torch.Tensor:
    if base.dtype != torch.uint8 or base.dim() != 1:
        raise ValueError(f"layout base tensors must be 1-D uint8, got {base.dtype} {tuple(base.shape)}.")
    if base.numel() < geom.tensor_bytes:
        raise ValueError(f"base tensor of {base.numel()} B is smaller than the layout's {geom.tensor_bytes} B.")
    return base.view(geom.spec.dtype)


def _check_bases(bases: list[torch.Tensor], geom: KVGeometry) -> None:
    if len(bases) != geom.num_tensors:
        raise ValueError(f"{geom.layout.value} layout needs {geom.num_tensors} base tensors, got {len(bases)}.")


def kv_cache_view(bases: list[torch.Tensor], geom: KVGeometry, layer: int, style: str = FLASH_ATTN) -> torch.Tensor:
    """Layer ``layer``'s KV cache as the engine expects it, zero-copy.

    ``flash_attn``: ``(2, N, block_size, H, D)``; ``flashinfer``: ``(N, 2, block_size, H, D)``.
    """
    _check_bases(bases, geom)
    s = geom.spec
    if s.kv_factor != 2:
        raise ValueError("kv_cache_view needs K and V (kv_factor=2); use mla_view for a latent cache.")
    st = geom.layer_strides(layer)
    inner = (s.block_size, s.num_kv_heads, s.head_size)
    inner_strides = (s.num_kv_heads * s.head_size, s.head_size, 1)
    if style == FLASH_ATTN:
        size = (2, geom.num_blocks) + inner
        stride = (st.kv_stride, st.block_stride) + inner_strides
    elif style == FLASHINFER:
        size = (geom.num_blocks, 2) + inner
        stride = (st.block_stride, st.kv_stride) + inner_strides
    else:
        raise ValueError(f"unknown view style {style!r}; use one of {VIEW_STYLES}.")
    return torch.as_strided(_typed(bases[st.tensor], geom), size, stride, st.offset)


def k_v_views(bases: list[torch.Tensor], geom: KVGeometry, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``layer``'s K and V caches, each ``[N, block_size, H, D]`` (strided)."""
    return kv_cache_view(bases, geom, layer, FLASH_ATTN).unbind(0)


def mla_view(bases: list[torch.Tensor], geom: KVGeometry, layer: int) -> torch.Tensor:
    """Layer ``layer``'s latent cache ``(N, block_size, head_size)`` (MLA: kv_factor=1, H=1)."""
    _check_bases(bases, geom)
    s = geom.spec
    if s.kv_factor != 1 or s.num_kv_heads != 1:
        raise ValueError("mla_view needs kv_factor=1 and num_kv_heads=1.")
    st = geom.layer_strides(layer)
    return torch.as_strided(
        _typed(bases[st.tensor], geom),
        (geom.num_blocks, s.block_size, s.head_size),
        (st.block_stride, s.head_size, 1),
        st.offset,
    )


def sglang_buffers(bases: list[torch.Tensor], geom: KVGeometry, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang per-token K and V buffers ``[N * block_size, H, D]`` for one layer.

    A per-token buffer needs one token stride everywhere, which holds when
    blocks are dense per layer (per-layer layout) or one token long (the
    token-major placement of :func:`token_major_geometry`, for any SGLang page size).
    """
    _check_bases(bases, geom)
    s = geom.spec
    if s.kv_factor != 2:
        raise ValueError("sglang_buffers needs K and V (kv_factor=2).")
    st = geom.layer_strides(layer)
    token = s.num_kv_heads * s.head_size
    if s.block_size != 1 and st.block_stride != s.block_size * token:
        raise KVCachedConfigError(
            "SGLang per-token buffers on the contiguous layout need the token-major geometry (blocks of "
            f"one token), got block_size={s.block_size}; build it with token_major_geometry()."
        )
    token_stride = st.block_stride // s.block_size
    typed = _typed(bases[st.tensor], geom)
    size = (geom.num_blocks * s.block_size, s.num_kv_heads, s.head_size)
    stride = (token_stride, s.head_size, 1)
    k = torch.as_strided(typed, size, stride, st.offset)
    v = torch.as_strided(typed, size, stride, st.offset + st.kv_stride)
    return k, v


def engine_pages_per_page(page_tokens: int, token_bytes: int, page_size: int) -> int:
    """How many engine pages of ``page_tokens`` tokens of ``token_bytes`` one kvcached page holds.

    KVCachedConfigError unless they divide it exactly: an engine page straddling two
    kvcached pages would have part of its tokens unmapped while the allocator hands it out.
    """
    for name, value in (("page_tokens", page_tokens), ("token_bytes", token_bytes), ("page_size", page_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise KVCachedConfigError(f"{name} must be a positive int, got {value!r}.")
    tokens_per_page = page_size // token_bytes
    if page_size % token_bytes or tokens_per_page % page_tokens:
        fit = f"a power-of-two page size of at most {tokens_per_page} tokens" if tokens_per_page else "a smaller token"
        raise KVCachedConfigError(
            f"an engine page of {page_tokens} tokens x {token_bytes} B does not divide the {page_size >> 20} MiB "
            f"kvcached page ({page_size / token_bytes:g} tokens), so engine pages would straddle kvcached pages; "
            f"use {fit}, or set KVCACHED_PAGE_SIZE_MB to a multiple of the engine page."
        )
    return tokens_per_page // page_tokens


def token_major_geometry(spec: KVSpec, layout: Layout | str | bool, page_size: int) -> KVGeometry:
    """The one-token-block geometry of an engine that pages tokens ``spec.block_size`` at a time.

    ``spec.block_size`` is the engine's page size ``P`` (SGLang's ``page_size``) and
    ``spec.num_blocks`` its number of pages; KVCachedConfigError unless ``P`` tokens
    divide the page (:func:`engine_pages_per_page`).
    """
    layout = Layout.parse(layout)
    token = replace(spec, block_size=1, num_blocks=spec.num_blocks * spec.block_size)
    engine_pages_per_page(spec.block_size, token.block_bytes, page_size)
    geom = KVGeometry(token, layout, page_size)
    # the allocator's geometry has blocks of P tokens: page p must be the same bytes in both
    paged = KVGeometry(spec, layout, page_size)
    if (paged.num_pages, paged.page_group_bytes) != (geom.num_pages, geom.page_group_bytes):
        raise AssertionError(f"token-major and paged geometries disagree: {paged} vs {geom}")
    return geom


def token_page_view(buffer: torch.Tensor, page_tokens: int) -> torch.Tensor:
    """A per-token buffer ``[num_tokens, *rest]`` as pages ``[num_tokens // P, P, *rest]``, zero-copy.

    What SGLang's paged backends do (``k_buffer.view(-1, page_size, H, D)``); on the
    token-major placement the page stride is ``P`` token strides, which kernels that
    honour strides read correctly and dense-addressing kernels do not.
    """
    if not isinstance(page_tokens, int) or isinstance(page_tokens, bool) or page_tokens <= 0:
        raise KVCachedConfigError(f"page_tokens must be a positive int, got {page_tokens!r}.")
    if buffer.dim() < 2 or buffer.shape[0] % page_tokens:
        raise KVCachedConfigError(
            f"a per-token buffer of shape {tuple(buffer.shape)} is not whole pages of {page_tokens} tokens."
        )
    size = (buffer.shape[0] // page_tokens, page_tokens, *buffer.shape[1:])
    stride = (buffer.stride(0) * page_tokens, *buffer.stride())
    return torch.as_strided(buffer, size, stride, buffer.storage_offset())


def sglang_paged_kv(bases: list[torch.Tensor], geom: KVGeometry, layer: int,
                    page_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``layer``'s K and V as SGLang's paged backends see them: ``[N // P, P, H, D]`` (strided).

    ``geom`` is a :func:`token_major_geometry`; ``page_tokens`` the SGLang page size ``P``.
    """
    k, v = sglang_buffers(bases, geom, layer)
    return token_page_view(k, page_tokens), token_page_view(v, page_tokens)


def allocate_plain(geom: KVGeometry, device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """Ordinary (non-VMM) base tensors with the layout's sizes: for tests and kernels' users."""
    return [torch.empty(geom.tensor_bytes, dtype=torch.uint8, device=device) for _ in range(geom.num_tensors)]


# -- recurrent state slots (Mamba / GDN) -------------------------------------
STATE_ALIGN = 256  # each state array of a slot starts 256-B aligned, as a fresh allocation would


@dataclass(frozen=True)
class StateSlots:
    """Where the recurrent states of a hybrid model's Mamba/linear-attention layers live, a slot per request.

    Slot-major, in the order of SGLang's envelope layout: slot ``s`` owns the bytes
    ``[s * slot_bytes, (s + 1) * slot_bytes)`` of one virtual tensor, holding each state array of
    every layer (``[array 0 of layer 0..L-1][array 1 of layer 0..L-1]...``, each array
    ``STATE_ALIGN``-aligned). So a slot is one byte range, and the pages under it map when the slot
    is handed out. ``slot_bytes`` is a power-of-two fraction of the page (several slots a page) or
    a whole number of pages (``cells`` pages a slot), never a page and a bit: no slot straddles a
    page it does not own. That padding costs less than a page a slot (SGLang's slot of Qwen3-Next
    at TP 1 is ~74 MiB) or, for states under a page, up to 2x of a small slot.

    In :class:`KVGeometry` terms a slot is a block of one token, ``cells`` layers of ``cell_bytes``
    each, in the contiguous layout (which places a block's layers side by side): the allocator and
    its manager then hand out slots as they hand out KV blocks.
    """

    arrays: tuple[tuple[tuple[int, ...], torch.dtype], ...]  # (shape, dtype) of one layer's array
    num_layers: int
    page_size: int

    def __post_init__(self) -> None:
        if not isinstance(self.num_layers, int) or isinstance(self.num_layers, bool) or self.num_layers <= 0:
            raise KVCachedConfigError(f"num_layers must be a positive int, got {self.num_layers!r}.")
        if self.page_size <= 0 or self.page_size % (2 << 20):
            raise KVCachedConfigError(f"page size {self.page_size} B is not a positive multiple of 2 MiB.")
        if not self.arrays:
            raise KVCachedConfigError("a state slot needs at least one array.")
        for shape, dtype in self.arrays:
            # a dimension of 0 is an array the model does not use (LFM2's temporal state): it takes no bytes
            if not shape or any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in shape):
                raise KVCachedConfigError(f"state array shape {shape!r} must be a non-empty tuple of ints >= 0.")
            if not isinstance(dtype, torch.dtype):
                raise KVCachedConfigError(f"state array dtype {dtype!r} is not a torch dtype.")
        if self.entry_bytes == 0:
            raise KVCachedConfigError(f"state arrays {self.arrays!r} take no bytes: there is no state to keep.")

    def _layer_bytes(self, i: int) -> int:
        shape, dtype = self.arrays[i]
        return math.prod(shape) * torch.empty((), dtype=dtype).element_size()

    @property
    def offsets(self) -> tuple[int, ...]:
        """Byte offset of each array's layer 0 within a slot."""
        out, at = [], 0
        for i in range(len(self.arrays)):
            at = -(-at // STATE_ALIGN) * STATE_ALIGN
            out.append(at)
            at += self.num_layers * self._layer_bytes(i)
        return tuple(out)

    @property
    def entry_bytes(self) -> int:
        """Bytes a slot's states take, before the padding to ``slot_bytes``."""
        return self.offsets[-1] + self.num_layers * self._layer_bytes(len(self.arrays) - 1)

    @property
    def cell_bytes(self) -> int:
        if self.entry_bytes > self.page_size:
            return self.page_size
        cell = self.page_size
        while cell // 2 >= self.entry_bytes and (cell // 2) % STATE_ALIGN == 0:
            cell //= 2
        return cell

    @property
    def cells(self) -> int:
        return -(-self.entry_bytes // self.cell_bytes)

    @property
    def slot_bytes(self) -> int:
        return self.cells * self.cell_bytes

    def geometry(self, num_slots: int) -> KVGeometry:
        """The allocator's view: ``num_slots`` one-token blocks of ``cells`` layers of ``cell_bytes``."""
        spec = KVSpec(self.cells, num_slots, 1, 1, self.cell_bytes, torch.uint8, 1)
        return KVGeometry(spec, Layout.CONTIGUOUS, self.page_size)


def state_views(base: torch.Tensor, slots: StateSlots, num_slots: int) -> list[torch.Tensor]:
    """Each state array as ``[num_layers, num_slots, *shape]`` over ``base`` (the slots' 1-D uint8 tensor),
    zero-copy: inner dims dense, the slot dim strided by ``slot_bytes`` (kernels that take a slot stride,
    as SGLang's do for its own envelope layout, read it as SGLang's dense tensors)."""
    if base.dtype != torch.uint8 or base.dim() != 1:
        raise ValueError(f"state base tensor must be 1-D uint8, got {base.dtype} {tuple(base.shape)}.")
    if base.numel() < num_slots * slots.slot_bytes:
        raise ValueError(f"base tensor of {base.numel()} B is smaller than {num_slots} slots of "
                         f"{slots.slot_bytes} B.")
    views = []
    for i, (offset, (shape, dtype)) in enumerate(zip(slots.offsets, slots.arrays, strict=True)):
        item = torch.empty((), dtype=dtype).element_size()
        inner = [1]
        for d in reversed(shape[1:]):
            inner.insert(0, inner[0] * d)
        stride = (slots._layer_bytes(i) // item, slots.slot_bytes // item, *inner)
        views.append(torch.as_strided(base.view(dtype), (slots.num_layers, num_slots, *shape), stride,
                                      offset // item))
    return views
