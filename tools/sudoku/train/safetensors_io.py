"""Minimal safetensors reader/writer (the format: u64 header length, JSON header, raw bytes),
so the training recipe needs nothing beyond Debian's python3-torch."""
import json
import struct

import torch

_DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16}
_NAMES = {v: k for k, v in _DTYPES.items()}


def load(path: str) -> dict:
    """name → tensor (dtype as stored)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        dt = _DTYPES[info["dtype"]]
        t = torch.frombuffer(bytearray(data[a:b]), dtype=dt)
        out[name] = t.reshape(info["shape"]).clone()
    return out


def save(path: str, tensors: dict, metadata: dict | None = None) -> None:
    """Writes tensors (sorted by name, as HF does) in their own dtype."""
    header = {}
    blobs = []
    off = 0
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        raw = t.view(torch.int16).numpy().tobytes() if t.dtype == torch.bfloat16 \
            else t.numpy().tobytes()
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    if metadata:
        header["__metadata__"] = metadata
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
