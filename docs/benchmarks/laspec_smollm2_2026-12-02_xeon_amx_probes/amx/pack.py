"""VNNI packing of a weight (N, K) into AMX B tiles: (N/16, K/32, 2 pieces (bf16 hi, mid), 16, 16, 2)."""
import torch
def pack(w):
    N, K = w.shape
    Np, Kp = -(-N // 16) * 16, -(-K // 32) * 32
    wp = torch.zeros(Np, Kp); wp[:N, :K] = w
    hi = wp.bfloat16(); mid = (wp - hi.float()).bfloat16()
    out = []
    for piece in (hi, mid):
        t = piece.view(Np // 16, 16, Kp // 32, 16, 2).permute(0, 2, 3, 1, 4)  # nb, kb, r, c, e
        out.append(t)
    return torch.stack(out, 2).contiguous()  # nb, kb, piece, r, c, e
