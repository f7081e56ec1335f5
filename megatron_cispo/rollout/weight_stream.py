"""The trainer's weights as a stream of named buckets for a rollout engine: no full-model gather, no disk.

    for bucket in stream_buckets(chunks, namer=hf_namer(arch), bucket_bytes=256 << 20):  # collective
        staging.add(bucket.blocks, bucket.data)          # only rank `dst` receives buckets

Per PP stage one rank sends the dense weights: the one with DP = CP = 0 and TP rank 0; per EP rank one
rank sends its experts: the one with expert DP = 0 and expert TP rank 0. Their TP peers send them their
shards a row block at a time (point to point over TP), so no rank holds more than one gathered block
and one bucket beyond the model: about 2 x bucket_bytes (the receiving rank can pack straight into the
engine's buffer); a bucket is allocated no larger than what fills it: a sender's at most the bytes it
sends in all (sent_bytes), dst's receive buffer at most the largest other sender's. Tensors keep the
parameters' dtype. The other stages' senders forward their buckets to `dst` point to point, stage by
stage. `namer` names each block by the HF export mapping
(hf/mapping.pieces) or by megatron's full tensors (megatron_namer); a receiver writes block b into
the full tensor b.name at rows b.row.., columns b.col.. (rollout/weight_receiver.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
from torch import Tensor

from ..base.param_names import canonical_names, global_param_name, sends_param, shard_group, tp_split_dim

_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}


@dataclass(frozen=True)
class Region:
    """Rows [start, stop) of one TP rank's shard fill target `name` (full shape `shape`) from (row, col)."""

    name: str
    shape: tuple[int, ...]
    start: int
    stop: int
    row: int
    col: int


@dataclass(frozen=True)
class Block:
    """Part of target tensor `name` (full shape `shape`): rows row.., columns col.. (col 0 for 1-D),
    `dims` its own shape; bytes [offset, offset + nbytes) of its bucket's data, in `dtype`."""

    name: str
    shape: tuple[int, ...]
    row: int
    col: int
    dims: tuple[int, ...]
    dtype: str
    offset: int

    @property
    def nbytes(self) -> int:
        return _numel(self.dims) * _DTYPES[self.dtype].itemsize

    def view(self, data: Tensor) -> Tensor:
        """This block's tensor in `data` (its bucket's uint8 bytes): a view, no copy."""
        return data[self.offset:self.offset + self.nbytes].view(_DTYPES[self.dtype]).view(self.dims)


@dataclass(frozen=True)
class Bucket:
    """What one send carries: `blocks` and their bytes `data` ([n] uint8, valid until the next bucket)."""

    blocks: list[Block]
    data: Tensor


Namer = Callable[[str, tuple[int, ...], int, int, int, bool], list[Region]]
"""namer(global name, full megatron shape, tp rank, tp size, split dim (-1: not split), gated fc1)
-> the regions of that rank's shard, in shard-row order."""


def _numel(dims) -> int:
    n = 1
    for d in dims:
        n *= int(d)
    return n


def megatron_namer(name, full, rank, size, dim, glu) -> list[Region]:
    """Blocks named by megatron's full tensors (runner/weights.gather_full_state's layout)."""
    full = tuple(full)
    if dim < 0:
        return [Region(name, full, 0, full[0], 0, 0)]
    if dim == 1:
        rows = full[0]
        return [Region(name, full, 0, rows, 0, rank * (full[1] // size))]
    n = full[0] // size
    if glu:  # rank r holds [gate_r; up_r]; the full tensor is [gate; up]
        h = n // 2
        return [Region(name, full, 0, h, rank * h, 0), Region(name, full, h, n, full[0] // 2 + rank * h, 0)]
    return [Region(name, full, 0, n, rank * n, 0)]


def hf_namer(arch) -> Namer:
    """Blocks named by the HF export mapping: the HF tensors run.export_hf writes, vocabulary padding dropped."""
    from ..hf.mapping import ZEROS, hf_shapes, megatron_names, pieces

    shapes, known = hf_shapes(arch), set(megatron_names(arch))

    def namer(name, full, rank, size, dim, glu) -> list[Region]:
        if name not in known:  # a tied output layer (the last stage's copy of the embedding): HF has none
            return []
        out, at = [], 0
        for p in (pieces(name, arch, rank=rank, size=size) if dim >= 0 else pieces(name, arch)):
            if p.name != ZEROS:
                out.append(Region(p.name, shapes[p.name], at, at + p.rows, p.start, p.cols.start if p.cols else 0))
            at += p.rows
        return out
    return namer


class _Packer:
    """Fills one bucket buffer (`buffer`, or a new one); fits() says when the next block needs the next bucket."""

    def __init__(self, nbytes: int, device, buffer: Optional[Tensor] = None):
        self.data = buffer if buffer is not None else torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.blocks: list[Block] = []
        self.used = 0

    def fits(self, nbytes: int) -> bool:
        return self.used + nbytes <= self.data.numel()

    def add(self, region: Region, t: Tensor) -> None:
        dims = tuple(t.shape)
        raw = t.contiguous().view(-1).view(torch.uint8)
        self.data[self.used:self.used + raw.numel()].copy_(raw)
        self.blocks.append(Block(region.name, region.shape, region.row, region.col, dims, str(t.dtype), self.used))
        self.used += raw.numel()

    def take(self) -> Optional[Bucket]:
        if not self.blocks:
            return None
        bucket = Bucket(self.blocks, self.data[:self.used])
        self.blocks, self.used = [], 0
        return bucket


def tensor_buckets(tensors: dict[str, Tensor], bucket_bytes: int) -> Iterator[Bucket]:
    """Single process: full tensors {name: tensor} as buckets (row blocks of a tensor larger than one), in
    one buffer of min(bucket_bytes, the tensors' bytes)."""
    packer, total = None, sum(t.numel() * t.element_size() for t in tensors.values())
    for name, t in tensors.items():
        t = t.detach()
        packer = packer or _Packer(min(bucket_bytes, total), t.device)
        row_bytes = max(1, t[0].numel() if t.dim() > 1 else 1) * t.element_size()
        rows = bucket_bytes // row_bytes
        if rows < 1:
            raise ValueError(f"bucket of {bucket_bytes} bytes is smaller than one row of {name} ({row_bytes} bytes)")
        for s in range(0, t.shape[0], rows):
            block = t[s:s + rows]
            if not packer.fits(block.numel() * block.element_size()):
                yield packer.take()
            packer.add(Region(name, tuple(t.shape), 0, 0, s, 0), block)
    last = packer.take() if packer is not None else None
    if last is not None:
        yield last


def _tensors(chunks, tensors):
    """(module, local name, param, the tensor to send) for every parameter this rank's copy of is sent
    (sends_param); `tensors` need hold only those."""
    for i, chunk in enumerate(chunks):
        mod = getattr(chunk, "module", chunk)
        for name, p in mod.named_parameters():
            if sends_param(name):
                yield mod, name, p, (p.detach() if tensors is None else tensors[i][name])


def _shape_of(mod, name: str, p, t: Tensor):
    """(canonical global name, full shape, TP split dim or -1, gated fc1, split over TP, and its shard
    group, size, rank) of parameter `name` of module `mod`, whose tensor to send is `t`."""
    group, size, rank = shard_group(name)
    split = bool(getattr(p, "tensor_model_parallel", False)) and size > 1
    gname = next(iter(canonical_names({global_param_name(mod, name): None})))
    dim = tp_split_dim(gname) if split else -1
    full = list(t.shape)
    if split:
        full[dim] *= size
    glu = bool(mod.config.gated_linear_unit) and gname.endswith("linear_fc1.weight")
    return gname, full, dim, glu, split, group, size, rank


def stream_manifest(chunks, namer: Namer) -> dict[str, tuple[int, ...]]:
    """Collective over the world: {name: full shape} of every tensor stream_buckets(chunks, namer=namer)
    sends, from every sender's regions (what a receiver's Staging needs to know the stream complete)."""
    import torch.distributed as dist

    own = {}
    for mod, name, p, t in _tensors(chunks, None):
        gname, full, dim, glu, split, _, size, rank = _shape_of(mod, name, p, t)
        if rank == 0:
            for r in (range(size) if split else [0]):
                own.update({g.name: tuple(g.shape) for g in namer(gname, tuple(full), r, size, dim, glu)})
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return own
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, own)
    return {k: v for part in every for k, v in part.items()}


def _parts(chunks, namer: Namer, tensors):
    """(global name, tensor to send, bytes of one of its rows, split over TP, shard group, size, rank, the
    regions of each TP rank's shard) of every parameter this rank takes part in sending: its own copy at
    shard rank 0, or a TP shard it gathers (rank 0) or hands to the gather (the others)."""
    for mod, name, p, t in _tensors(chunks, tensors):
        gname, full, dim, glu, split, group, size, rank = _shape_of(mod, name, p, t)
        if not split and rank != 0:
            continue
        row_bytes = t[0].numel() * t.element_size() if t.dim() > 0 else t.element_size()
        regions = {r: namer(gname, tuple(full), r, size, dim, glu) for r in (range(size) if split else [0])}
        yield gname, t, row_bytes, split, group, size, rank, regions


def sent_bytes(chunks, namer: Namer, tensors=None) -> int:
    """Bytes this rank packs into buckets over one stream_buckets(chunks, namer=namer) (0: it packs none),
    whatever bucket_bytes: every block of the regions it sends, gathered TP shards included. No collective."""
    return sum((g.stop - g.start) * row_bytes for _, _, row_bytes, _, _, _, rank, regions
               in _parts(chunks, namer, tensors) if rank == 0 for gs in regions.values() for g in gs)


def _own_buckets(chunks, namer: Namer, bucket_bytes: int, tensors, buffer=None, sent: int = 0) -> Iterator[Bucket]:
    """This rank's part of the stream: TP gathers (as sender or peer); buckets only on senders, packed in
    `buffer` or in one of min(bucket_bytes, sent) bytes (`sent`: sent_bytes, so a small model takes no
    whole bucket). A parameter goes from its DP = 0 copy (expert DP for experts: sends_param), so TP peers
    skip alike."""
    packer, scratch = None, {}
    for gname, t, row_bytes, split, group, size, rank, regions in _parts(chunks, namer, tensors):
        rows = bucket_bytes // (row_bytes * (size if split else 1))
        if rows < 1:
            raise ValueError(f"rollout.sync_bucket_mb={bucket_bytes / 2**20:g} is smaller than one row of {gname} "
                             f"({row_bytes * (size if split else 1)} bytes gathered over TP); raise it")
        if not any(regions.values()):
            continue  # nothing of it is sent (every TP rank decides alike)
        if packer is None and rank == 0:
            packer = _Packer(min(bucket_bytes, sent), t.device, buffer)
        for s in range(0, t.shape[0], rows):
            part = t[s:s + rows].contiguous()
            if split:
                parts = _gather(part, group, size, rank, scratch)
            else:
                parts = [part]
            if rank != 0:
                continue
            e = s + part.shape[0]
            for r, x in enumerate(parts):
                for g in regions[r]:
                    lo, hi = max(s, g.start), min(e, g.stop)
                    if lo >= hi:
                        continue
                    block = x[lo - s:hi - s]
                    if not packer.fits(block.numel() * block.element_size()):
                        yield packer.take()
                    packer.add(Region(g.name, g.shape, 0, 0, g.row + lo - g.start, g.col), block)
            del parts
    if packer is not None:
        last = packer.take()
        if last is not None:
            yield last


def _gather(part: Tensor, group, size: int, rank: int, scratch: dict) -> Optional[list[Tensor]]:
    """TP rank 0: every TP rank's `part` (same shape), received into one reused buffer (`scratch`, at
    most a bucket); the other ranks send theirs and get None. Point to point: gloo's gather waited 3x longer."""
    import torch.distributed as dist

    if rank != 0:
        dist.send(part, dst=dist.get_global_rank(group, 0), group=group)
        return None
    n = part.numel() * part.element_size()
    buf = scratch.get(part.device)
    if buf is None or buf.numel() < n * (size - 1):
        buf = scratch[part.device] = torch.empty(max(n * (size - 1), 1 << 20), dtype=torch.uint8, device=part.device)
    parts = [part] + [buf[i * n:(i + 1) * n].view(part.dtype).view(part.shape) for i in range(size - 1)]
    reqs = [dist.irecv(x, src=dist.get_global_rank(group, r), group=group) for r, x in enumerate(parts[1:], 1)]
    for q in reqs:
        q.wait()
    return parts


def stream_buckets(chunks, *, namer: Namer, bucket_bytes: int, tensors=None, dst: int = 0,
                   buffer: Optional[Tensor] = None) -> Iterator[Bucket]:
    """Collective over the world: the model's weights as buckets of at most `bucket_bytes`, yielded on
    rank `dst` only (every other rank must still run the generator to its end).

    chunks: the model chunks (this rank's PP stage). tensors: None for the live parameters, or per
    chunk {local parameter name: tensor} (a lagged version's shards, same shapes). Senders other than
    dst send each bucket's block list (send_object_list) and bytes (send) to dst, stage after stage;
    dst yields its own first, then theirs. A bucket's data is reused: use it before the next one.
    buffer: dst's bucket memory ([bucket_bytes] uint8, e.g. the engine's shared file): every bucket dst
    yields is packed or received there, so dst holds one bucket plus one gathered row block (plus a
    receive bucket on the parameters' device when that is not the buffer's: NCCL takes no CPU tensor).
    Without it each buffer is no larger than what fills it: a sender's packs min(bucket_bytes, its
    sent_bytes), dst's receive buffer min(bucket_bytes, the largest other sender's sent_bytes), which
    every rank learns in one all_gather_object.
    """
    import torch.distributed as dist

    if buffer is not None and buffer.numel() < bucket_bytes:
        raise ValueError(f"buffer holds {buffer.numel()} bytes, less than bucket_bytes={bucket_bytes}")
    sent = sent_bytes(chunks, namer, tensors)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        yield from _own_buckets(chunks, namer, bucket_bytes, tensors, buffer, sent)
        return
    me = dist.get_rank()
    senders = [None] * dist.get_world_size()  # every rank's sent_bytes: 0 on a rank that sends nothing
    dist.all_gather_object(senders, sent)
    device = next(getattr(chunks[0], "module", chunks[0]).parameters()).device
    obj_dev = None if device.type == "cpu" else device
    if me == dst:
        yield from _own_buckets(chunks, namer, bucket_bytes, tensors, buffer, sent)
        # received on the parameters' device (NCCL takes no CPU tensor), then copied to a CPU buffer
        largest = min(bucket_bytes, max((n for r, n in enumerate(senders) if r != dst), default=0))
        same = buffer is not None and buffer.device == device
        buf = buffer if same else torch.empty(largest, dtype=torch.uint8, device=device) if largest else None
        for src in (r for r, n in enumerate(senders) if n and r != dst):
            while True:
                box = [None]
                dist.recv_object_list(box, src=src, device=obj_dev)
                if box[0] is None:
                    break
                blocks, n = box[0]
                dist.recv(buf[:n], src=src)
                if buffer is not None and not same:
                    buffer[:n].copy_(buf[:n])
                yield Bucket(blocks, buffer[:n] if buffer is not None else buf[:n])
        return
    for bucket in _own_buckets(chunks, namer, bucket_bytes, tensors, sent=sent):
        dist.send_object_list([(bucket.blocks, bucket.data.numel())], dst=dst, device=obj_dev)
        dist.send(bucket.data, dst=dst)
    if sent:
        dist.send_object_list([None], dst=dst, device=obj_dev)


def bucket_problem(arch, bucket_mb: float, *, tp: int) -> Optional[str]:
    """One line when a bucket of `bucket_mb` MiB cannot hold one gathered row of some tensor of `arch`
    (fp32, over tp ranks), else None."""
    from ..hf.mapping import hf_shapes

    for name, shape in hf_shapes(arch).items():
        row = _numel(shape[1:]) * 4 * tp
        if row > bucket_mb * 2**20:
            return (f"rollout.sync_bucket_mb={bucket_mb:g} ({int(bucket_mb * 2**20)} bytes) is smaller than one row "
                    f"of {name} gathered over tp={tp} ({row} bytes in fp32); raise it")
    return None
