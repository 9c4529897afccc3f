"""A preallocated key/value cache for autoregressive decoding.

It stores only the ``n_kv_heads`` K/V heads (GQA and MQA shrink it by ``n_heads / n_kv_heads``), in
buffers allocated once, so decoding never reallocates or copies what is already cached. Every write is
validated before anything is touched: a write that fails leaves the cache exactly as it was.

Shapes:
    b: batch, h_kv: key/value heads, s: new tokens, d_h: head width.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from .kv_support import KVCheckpoint, check_count, check_device, check_write, overflow_message, short_name

__all__ = ["KVCache", "KVCheckpoint"]


class KVCache:
    """Key/value buffers of one attention layer.

    Memory: ``2 * b * max_len * n_kv_heads * d_head * itemsize`` bytes (:attr:`nbytes`).

    The write position lives twice: as :attr:`length`, a Python int that eager code reads without waiting for
    the device, and as :attr:`position`, a 0-d tensor on the cache's device that compiled code reads
    (:meth:`write_static`), so a step traced by ``torch.compile`` has the same shapes and the same Python values
    at every position: one graph, and one CUDA graph under ``mode="reduce-overhead"``, serves them all. Eager
    writes keep both. Once compiled or exported code has written the cache (:meth:`write_static`), every
    host-side use reads the position back (a synchronisation on CUDA, even after :meth:`reset`): an exported
    program advances it without any Python code running, so the host's own count can no longer be trusted.
    A plain object rather than an ``nn.Module`` on purpose: ``torch.compile`` treats integer attributes of
    modules as constants.

    One cache belongs to one layer: :meth:`claim` binds it to its first owner and refuses any other.
    Not thread-safe: two threads decoding into one cache lose updates without an error (each reads the
    same ``length`` and overwrites the other's slots), so use one cache per decoding thread.
    :meth:`checkpoint` and :meth:`restore` undo a write (say, of a forward that fails after it), at the
    cost of copying the new tokens' slots, never the cached context.

    Shapes:
        keys, values: (b, h_kv, max_len, d_h); the filled prefix is ``[:, :, :length]``.

    Example:
        >>> cache = KVCache(batch_size=2, max_len=16, n_kv_heads=4, d_head=8)
        >>> cache.nbytes == 2 * 2 * 16 * 4 * 8 * 4
        True
        >>> k, v = cache.update(torch.randn(2, 4, 3, 8), torch.randn(2, 4, 3, 8))
        >>> k.shape, cache.length
        (torch.Size([2, 4, 3, 8]), 3)
        >>> saved = cache.checkpoint(2)
        >>> _ = cache.update(torch.randn(2, 4, 2, 8), torch.randn(2, 4, 2, 8))
        >>> cache.restore(saved)
        >>> cache.length
        3
    """

    keys: torch.Tensor
    values: torch.Tensor

    def __init__(self, batch_size: int, max_len: int, n_kv_heads: int, d_head: int, *,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        # batch_size may be 0 (an empty batch decodes to empty outputs, like every other path).
        for name, value, low in (("batch_size", batch_size, 0), ("max_len", max_len, 1),
                                 ("n_kv_heads", n_kv_heads, 1), ("d_head", d_head, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                kind = "non-negative" if low == 0 else "positive"
                raise ValueError(f"{name} must be a {kind} int, got {value!r}")
        dtype = dtype or torch.get_default_dtype()
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"cache dtype must be a floating torch.dtype, got {dtype!r}")
        try:
            device = torch.device(device) if device is not None else None
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device must be a torch.device or a string such as 'cpu' or 'cuda:0', "
                             f"got {device!r}") from exc
        if device is not None:
            if device.type == "cuda" and not torch.cuda.is_available():
                raise ValueError(f"device {str(device)!r} was requested but CUDA is not available here")
            check_device("device", str(device))  # the layer's check: else the allocation's error says out of memory
        shape = (batch_size, n_kv_heads, max_len, d_head)
        numel = batch_size * n_kv_heads * max_len * d_head
        nbytes = 2 * numel * dtype.itemsize
        if numel > 2**63 - 1:
            raise ValueError(f"a KVCache of shape (b, h_kv, max_len, d_h) = {shape} has {numel} elements per buffer, "
                             f"more than a tensor can hold (2**63 - 1); use a smaller max_len or batch_size")
        try:
            self.keys = torch.zeros(shape, dtype=dtype, device=device)
            self.values = torch.zeros(shape, dtype=dtype, device=device)
        except (RuntimeError, MemoryError) as exc:  # out of memory: say what was asked for
            raise ValueError(f"a KVCache of shape (b, h_kv, max_len, d_h) = {shape} needs {nbytes} bytes, which "
                             f"could not be allocated; use a smaller max_len or batch_size") from exc
        self.batch_size, self.max_len, self.n_kv_heads, self.d_head = batch_size, max_len, n_kv_heads, d_head
        self._length = 0
        #: The next write's slot, on the cache's device (what compiled steps read and advance).
        self.position = torch.zeros((), dtype=torch.long, device=self.keys.device)
        self._refused = torch.zeros((), dtype=torch.long, device=self.keys.device)  # compiled steps with no room
        self._device_writes = False  # compiled/exported code has written the position: the host always reads it
        self._slots = torch.arange(max_len, device=self.keys.device)  # key index j, for the position mask
        self._next_slot = self.position.view(1)  # (1,): the next write's slot, as an index
        self._mark_static()
        self._owner: Any = None
        self._resets = 0
        self._cuts: list[int] = []  # the length each crop (or restore) since the last reset cut the cache to

    def _mark_static(self) -> None:
        if self.keys.device.type != "cpu" and not torch.compiler.is_compiling():
            # Compiled steps write these tensors in place; a CUDA graph may do so only to tensors whose address it
            # can trust to stay the same (as transformers marks its StaticCache's), else it is not used at all.
            # The CPU has no graphs to replay, and the mark would cost a CPU cache a second of importing dynamo.
            from torch._dynamo import mark_static_address

            for t in (self.keys, self.values, self.position, self._refused, self._slots):
                mark_static_address(t)

    # -- copies: a branch of the decoding state (beam search) has its own buffers and the same layer ----------
    def __deepcopy__(self, memo: dict[int, Any]) -> "KVCache":
        new = object.__new__(type(self))
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            # The layer is not the cache's to copy: the copy decodes for the same layer (or for its copy, when
            # the same deepcopy has copied it already).
            copied = memo.get(id(value), value) if name == "_owner" else copy.deepcopy(value, memo)
            new.__dict__[name] = copied
        new._next_slot = new.position.view(1)
        new._mark_static()
        return new

    def __copy__(self) -> "KVCache":
        """``copy.copy(cache)`` is a branch too, as :func:`copy.deepcopy` makes it: sharing the buffers or the
        position would let two branches overwrite each other's slots."""
        return self.__deepcopy__({})

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_owner"] = None  # a pickle carries the cached positions, not the layer: the first user claims it
        del state["_next_slot"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("_cuts", [])  # a pickle of an older version
        self._next_slot = self.position.view(1)
        self._mark_static()

    @property
    def owner(self) -> Any:
        """The object (a layer) this cache was :meth:`claim`-ed by, or None."""
        return self._owner

    def claim(self, owner: object) -> None:
        """Bind this cache to ``owner`` (a layer); a later claim by any other object raises ValueError.

        The first call binds (and keeps a reference to ``owner``); calls with the same object are no-ops,
        cheap enough for every forward. :meth:`reset` keeps the owner.
        """
        if self._owner is owner:
            return
        if self._owner is None:
            self._owner = owner
            return
        raise ValueError(f"this KVCache belongs to {short_name(self._owner)}, not {short_name(owner)}: one cache per "
                         f"layer; make another with layer.new_cache(...)")

    @property
    def length(self) -> int:
        """Number of positions written so far (the next write starts here).

        Once compiled or exported steps (:meth:`write_static`) wrote the cache, this reads the device's position
        (a synchronisation), and raises the overflow ``ValueError`` if any of them found the cache full."""
        if self._device_writes:
            self._read_position()
        return self._length

    def _read_position(self) -> None:
        """Bring the host's length up to the device's position after compiled steps; report refused steps.

        The flag stays set: an exported program (``torch.export``) writes the position but never replays a
        Python attribute write, so once compiled or exported code has written this cache, the host never
        trusts its own length again (one read of the position per host use: a synchronisation on CUDA)."""
        self._length = int(self.position)
        refused = int(self._refused)
        if refused:
            self._refused.zero_()
            # A refused step had fewer free positions than new tokens (all written, for a one-token step).
            raise ValueError(f"cache overflow: {refused} compiled step(s) found all max_len={self.max_len} positions "
                             f"written or too few free for their new tokens ({self._length} written now) and were "
                             f"refused (nothing was written; each attended to nothing: a zero context); allocate a "
                             f"larger cache or reset() it")

    @property
    def nbytes(self) -> int:
        """Bytes held by the key and value buffers."""
        return self.keys.nbytes + self.values.nbytes

    @property
    def dtype(self) -> torch.dtype:
        return self.keys.dtype

    def reset(self) -> None:
        """Forget every cached position. The buffers are kept and zeroed, as a new cache's: a whole-buffer read
        (compiled steps, half precision on CUDA) masks them out, and a masked NaN or inf would still poison it."""
        self._length = 0
        self._resets += 1  # _device_writes stays: exported steps may write this cache again after the reset
        self._cuts = []
        with torch.no_grad():
            self.keys.zero_()
            self.values.zero_()
        self.position.zero_()
        self._refused.zero_()

    def crop(self, length: int) -> None:
        """Forget every position from ``length`` on (no-op if fewer are cached). Like :meth:`reset`, the buffers
        are kept and the forgotten slots zeroed; a layer whose forward fails after its write crops back to the
        length it started with. Use :meth:`checkpoint` to restore the slots bit for bit too; a crop below a
        checkpoint's length makes it unusable.
        """
        if isinstance(length, bool) or not isinstance(length, int) or length < 0:
            raise ValueError(f"crop needs a non-negative int length, got {length!r}")
        held = self.length
        if length < held:
            self._cut(length, held)

    def _cut(self, length: int, held: int) -> None:
        """Drop positions ``length .. held - 1``: zero their slots, set the length, record the cut."""
        with torch.no_grad():
            self.keys.narrow(2, length, held - length).zero_()
            self.values.narrow(2, length, held - length).zero_()
        self._length = length
        self.position.fill_(length)
        self._cuts.append(length)

    def checkpoint(self, n: int) -> KVCheckpoint:
        """Save what a write of ``n`` new positions would change: the length and those ``n`` slots.

        Pass the result to :meth:`restore` to put the cache back, bit for bit, after at most ``n``
        positions were written. Costs a copy of ``n`` slots (clamped to ``max_len``), not of the context.

        Shapes:
            saved keys, values: (b, h_kv, min(n, max_len - length), d_h)
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"checkpoint needs a non-negative int count of new positions, got {n!r}")
        start = self.length
        end = min(start + n, self.max_len)
        with torch.no_grad():
            keys = self.keys[:, :, start:end].clone()  # (b, h_kv, n, d_h)
            values = self.values[:, :, start:end].clone()
        return KVCheckpoint(self, start, self._resets, keys, values, len(self._cuts))

    def restore(self, checkpoint: KVCheckpoint) -> None:
        """Undo every write since ``checkpoint`` (taken by :meth:`checkpoint` on this cache).

        Refused, with the cache unchanged, if the checkpoint is another cache's, if the cache was reset
        since, cropped (or restored) below the checkpoint's length since, or if more positions were written
        than the checkpoint saved.
        """
        if not isinstance(checkpoint, KVCheckpoint):
            raise TypeError(f"restore needs a KVCheckpoint from cache.checkpoint(n), got {type(checkpoint).__name__}")
        if checkpoint.cache is not self:
            raise ValueError("this checkpoint was taken on another KVCache")
        start, saved = checkpoint.length, checkpoint.keys.shape[-2]
        if checkpoint.resets == self._resets and any(cut < start for cut in self._cuts[checkpoint.cuts:]):
            raise ValueError(f"cannot restore: the cache was cropped to {min(self._cuts[checkpoint.cuts:])} "
                             f"positions after this checkpoint was taken at length {start}, and the slots "
                             f"from there on may have been rewritten")
        if checkpoint.resets != self._resets or not start <= self.length <= start + saved:
            raise ValueError(
                f"cannot restore: the checkpoint saved {saved} positions after length {start}, but the cache "
                f"now holds {self._length}" + (" and was reset since" if checkpoint.resets != self._resets else "")
            )
        with torch.no_grad():
            self.keys[:, :, start:start + saved].copy_(checkpoint.keys)
            self.values[:, :, start:start + saved].copy_(checkpoint.values)
        if start < self._length:
            self._cuts.append(start)  # a later checkpoint past ``start`` saved slots this one just rewrote
        self._length = start
        self.position.fill_(start)

    def check_update(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Raise, without writing, if ``k``/``v`` cannot be appended."""
        check_write(self.keys, k, v)
        self.check_room(k.shape[-2])

    def check_room(self, n: int) -> None:
        """Raise the overflow ``ValueError`` if ``n`` more positions do not fit (``n``: a non-negative int)."""
        check_count("check_room", "n", n, None)
        if self.length + n > self.max_len:
            raise ValueError(overflow_message(self._length, n, self.max_len))

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new keys/values; return views of everything cached so far (no copy).

        The buffers keep no autograd history. New keys or values that have one are returned joined to the cached
        prefix instead (a copy), so gradients reach them as in one pass; earlier positions are constants. A caller
        that lets autograd save the views (queries with a gradient) must copy them: the next write, crop or reset
        changes them.

        Shapes:
            k, v: (b, h_kv, s, d_h) -> (b, h_kv, length + s, d_h) each
        """
        keys, values = self.keys, self.values
        if not (type(k) is torch.Tensor and type(v) is torch.Tensor and k.shape == v.shape and k.dim() == 4
                and k.shape[0] == self.batch_size and k.shape[1] == self.n_kv_heads and k.shape[3] == self.d_head
                and k.dtype == v.dtype == keys.dtype and k.device == v.device == keys.device):
            check_write(self.keys, k, v)  # a decode step's writes fit: only a misfit pays for the call and a message
        shape = k.shape
        if self._device_writes:
            self._read_position()
        start = self._length
        n = shape[2]
        end = start + n
        if end > self.max_len:
            if torch.compiler.is_compiling():
                return self._overflow_in_graph(k, v)
            raise ValueError(overflow_message(start, n, self.max_len))
        # Cached keys carry no autograd history (detached, as under no_grad), at no context-manager cost; the
        # call's own keys keep theirs in what it reads, so a prefill's gradients are those of one causal pass.
        own = k.requires_grad or v.requires_grad
        new_k, new_v = (k.detach(), v.detach()) if own else (k, v)
        if n == 1:  # a decode step: the device's position is ``start``; indexing by it costs less than a narrow
            keys.index_copy_(2, self._next_slot, new_k)
            values.index_copy_(2, self._next_slot, new_v)
        else:
            keys.narrow(2, start, n).copy_(new_k)  # narrow, not slicing: a decode step's fixed cost is mostly Python
            values.narrow(2, start, n).copy_(new_v)
        self._length = end
        self.position.fill_(end)  # compiled steps read it
        if own:
            return torch.cat((keys.narrow(2, 0, start), k), 2), torch.cat((values.narrow(2, 0, start), v), 2)
        return keys.narrow(2, 0, end), values.narrow(2, 0, end)  # (b, h_kv, length, d_h)

    def write_static(self, k: torch.Tensor, v: torch.Tensor, grad: bool = False) -> tuple[
            torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Write ``k``, ``v`` at :attr:`position` with device-side indexing: what a compiled step calls.

        Every shape and every Python value is the same at every position (the position is a tensor), so a
        step traced once serves them all. Returns the whole buffers (a copy holding the new keys' autograd
        history, where they have one; a copy too when ``grad``, autograd recording the call, which saves what it
        reads and must not see a later write change it), the mask of the keys each new query may
        read (query i sits at ``position + i`` and reads keys ``j <= position + i``), and ``room``: whether the
        write fitted. A write that does not fit changes nothing (the slots are rewritten with their own values,
        the position stays); the caller gives that step a zero context, and the cache's next host-side use raises the
        overflow ``ValueError`` (no host code runs between compiled steps, so none can raise at the step).
        ``k`` and ``v`` are checked as :meth:`update` checks them: a trace's edit may reshape them after the
        layer's checks. :meth:`rewind` undoes the write.

        Shapes:
            k, v: (b, h_kv, s, d_h) -> keys, values (b, h_kv, max_len, d_h), mask (1, 1, s, max_len) bool,
            room () bool
        """
        check_write(self.keys, k, v)  # metadata only: compiled code pays for it when tracing, not per step
        s = k.shape[-2]
        if s > self.max_len:  # overflows at any position, known when tracing: the graph raises, writing nothing
            keys, values = self._overflow_in_graph(k, v)
            ones = keys.new_ones((1, 1, s, keys.shape[2]), dtype=torch.bool)  # never read: the op raises first
            return keys, values, ones, ones[0, 0, 0, 0]
        pos = self.position
        room = pos + s <= self.max_len  # () bool
        idx = (pos + self._slots[:s]).clamp(max=self.max_len - 1)  # (s,): the slots, valid even when refused
        new_k = torch.where(room, k, self.keys.index_select(2, idx))  # a refused write rewrites the old values
        new_v = torch.where(room, v, self.values.index_select(2, idx))
        own = new_k.requires_grad or new_v.requires_grad  # as in update: the buffers carry no history
        self.keys.index_copy_(2, idx, new_k.detach() if own else new_k)
        self.values.index_copy_(2, idx, new_v.detach() if own else new_v)
        keys, values = self.keys, self.values
        if own:  # what the call reads: the buffers with its own keys, history kept
            keys, values = keys.index_copy(2, idx, new_k), values.index_copy(2, idx, new_v)
        elif grad:
            keys, values = keys.clone(), values.clone()
        mask = self._reads(pos, s)
        self.position.add_(room.long() * s)
        self._refused.add_((~room).long())
        self._device_writes = True
        return keys, values, mask, room

    def mark(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The device state a failed compiled step goes back to with :meth:`rewind`: copies of :attr:`position` and
        of the count of refused steps (tensors: nothing is read back to the host)."""
        return self.position.clone(), self._refused.clone()

    def rewind(self, before: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Undo the writes of :meth:`write_static` since ``before``: zero their slots, as :meth:`crop` does, and
        put the position and the count of refused steps back, on the device only (a failed compiled step calls it).

        Args:
            before: what :meth:`mark` returned before the writes to undo.
        """
        position, refused = before
        with torch.no_grad():
            written = ((self._slots >= position) & (self._slots < self.position)).view(1, 1, self.max_len, 1)
            self.keys.masked_fill_(written, 0)
            self.values.masked_fill_(written, 0)
        self.position.copy_(position)
        self._refused.copy_(refused)

    def read_mask(self, s: int) -> torch.Tensor:
        """The keys each of the last ``s`` written positions may read, over the whole buffer: query i (at
        position ``length - s + i``) reads keys ``j <= length - s + i``. With the whole buffers, it stands for the
        filled prefix at a shape that is the same at every position.

        Shapes:
            -> (1, 1, s, max_len) bool

        Example:
            >>> cache = KVCache(batch_size=1, max_len=4, n_kv_heads=1, d_head=2)
            >>> _ = cache.update(torch.randn(1, 1, 2, 2), torch.randn(1, 1, 2, 2))
            >>> cache.read_mask(1).int().flatten().tolist()
            [1, 1, 0, 0]
        """
        if s == 1 and type(s) is int:  # one query at the last position reads every filled one: one comparison
            return (self._slots < self.length).view(1, 1, 1, self.max_len)
        length = self.length
        check_count("read_mask", "s", s, length)
        return self._reads(length - s, s)

    def _reads(self, start: int | torch.Tensor, s: int) -> torch.Tensor:
        """(1, 1, s, max_len) bool: query i at position ``start + i`` reads keys ``j <= start + i``."""
        return (self._slots <= (start + self._slots[:s]).unsqueeze(-1)).view(1, 1, s, self.max_len)

    def _overflow_in_graph(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The traced overflow branch: a graph that raises the eager ValueError when it runs, writing nothing."""
        # The op's output is what the caller attends over, so no compiler can drop it as dead code.
        k = torch.ops.headwise.kv_cache_overflow(k, self.position, self.max_len)
        return (torch.cat([self.keys[:, :, :self._length], k], 2),  # (b, h_kv, length + s, d_h)
                torch.cat([self.values[:, :, :self._length], v], 2))

    def __repr__(self) -> str:
        # The device's position after compiled steps (a synchronisation), read without touching the host state:
        # printing a cache must neither raise nor swallow the overflow report that its next host use gives.
        length = int(self.position) if self._device_writes else self._length
        return (f"KVCache(batch_size={self.batch_size}, max_len={self.max_len}, n_kv_heads={self.n_kv_heads}, "
                f"d_head={self.d_head}, length={length}, dtype={self.keys.dtype})")
