"""ReplaySSM forward step in one launch with the state tile held in shared memory (route "mono.g"), in Gluon.

Route "mono.t" (replay_mono_mma.py) streams a program's state tile through Triton's pipelined
copies in column chunks; a flush row folds its tile in a second pass (or, joined, folds first and
forms its outputs from the folded state). What the small verify steps lost to FlashInfer's monolith
was traced to the flush rows (benchmarks/NOTES-kernels.md, session 21), and the step that kernel
takes and Triton cannot express is keeping the whole tile in shared memory between the outputs and
the fold. Gluon (Triton's lower-level language, shipped with Triton) addresses shared memory
directly, so here one program per (row, head), 4 warps, does:

    1. cp.async copies of the whole (P, N) state tile into swizzled shared memory, issued first
       (a flush row also copies its history's ring x and B rows);
    2. while they fly: the decays over the history followed by the step's tokens (one cumulative
       sum), C·B of every token with every history row and earlier token, and the coefficients
       w_tk = Δ_k e^{Λ_t - Λ_k} C_t·B_k (k <= the token's own position);
    3. y_t = e^{Λ_t} C_t S0ᵀ + Σ_k w_tk x_k + D x_t, the state read from shared memory in column
       chunks; a flush row folds each chunk from the same copy,
       S0 <- e^{Λ_h} S0 + Σ_j f_j x_j B_jᵀ, and writes it (fp32 pools only);
    4. the ring appends.

Every product is fp32 on the CUDA cores (no TF32), so outputs and folded states are at least as
accurate as the other routes'. Gluon kernels do not run under Triton's interpreter: the route is
tested on the GPU only.
"""

from __future__ import annotations

import torch
import triton

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
except ImportError:  # a Triton without Gluon: the route is refused at launch
    gluon = None

NUM_WARPS = 4


def gluon_supported() -> bool:
    return gluon is not None


if gluon is not None:

    @gluon.jit
    def _delta(kk, hc, o, R, Q: gl.constexpr, valid, rdt_ptr, xrow0, dt_ptr, i, sdt_b, sdt_t, sdt_h, h, bias,
               DT_SOFTPLUS: gl.constexpr):
        """Δ at positions kk (in kk's layout): history row (o + kk) % R from the ring for kk < h_c, the
        step's token kk - h_c (softplus(dt + bias)) up to h_c + Q, zero past them."""
        hist = kk < hc
        new = (kk >= hc) & (kk < hc + Q) & valid
        dth = gl.load(rdt_ptr + xrow0 + (o + kk) % R, mask=hist, other=0.0)
        v = gl.load(dt_ptr + i * sdt_b + (kk - hc) * sdt_t + h * sdt_h, mask=new, other=0.0).to(gl.float32)
        v = v + bias
        if DT_SOFTPLUS:
            v = gl.where(v > 20.0, v, gl.log(1.0 + gl.exp(gl.minimum(v, 20.0))))
        return gl.where(hist, dth, gl.where(new, v, 0.0))

    @gluon.jit
    def _mono_g_kernel(
        x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, state_ptr, rx_ptr, rB_ptr, rdt_ptr,
        ring_start_ptr, committed_ptr, idx_ptr, y_ptr, window,
        sx_b, sx_t, sx_h, sdt_b, sdt_t, sdt_h, sB_b, sB_t, sB_g, sC_b, sC_t, sC_g, sy_b, sy_t, sy_h, H, G, R,
        Q: gl.constexpr, QB: gl.constexpr, HB: gl.constexpr, KB: gl.constexpr, P: gl.constexpr,
        N: gl.constexpr, BP: gl.constexpr, NS: gl.constexpr, DT_SOFTPLUS: gl.constexpr, ORDER: gl.constexpr,
        L3: gl.constexpr, LX: gl.constexpr, LF: gl.constexpr, LCP: gl.constexpr, SW: gl.constexpr,
        SR: gl.constexpr, JC: gl.constexpr, MMA: gl.constexpr, OUT16: gl.constexpr, LM: gl.constexpr,
    ):
        NC: gl.constexpr = N // NS
        LS: gl.constexpr = gl.SliceLayout(0, L3)  # (P or KB, NS or KB): state chunks, x and B operands
        LC: gl.constexpr = gl.SliceLayout(1, L3)  # (QB, NS or KB): C chunks, coefficients
        LY: gl.constexpr = gl.SliceLayout(2, L3)  # (QB, P or KB): outputs, C·B
        pid_p = gl.program_id(0)
        p0 = pid_p * BP  # this program's BP rows of the tile
        h = gl.program_id(1)
        k = gl.program_id(2)
        i = k
        if ORDER:  # a grid of 2b rows: the flush rows' programs first (as replay_mono._ordered_row)
            b = gl.num_programs(2) // 2
            second = k >= b
            i = gl.where(second, k - b, k)
            s0 = gl.load(idx_ptr + i)
            f0 = (s0 >= 0) & (gl.load(committed_ptr + gl.maximum(s0, 0).to(gl.int64)) + Q > window)
            if f0 == second:
                return
        s = gl.load(idx_ptr + i)
        valid = s >= 0
        s64 = gl.maximum(s, 0).to(gl.int64)
        hc = gl.where(valid, gl.load(committed_ptr + s64), 0)
        o = gl.load(ring_start_ptr + s64)
        hpg = H // G
        g = h // hpg
        flush = valid & (hc + Q > window)
        sbase = (s64 * H + h) * (P * N)
        xrow0 = s64 * H * R + h * R
        Brow0 = s64 * G * R + g * R

        # 1. The state tile's copies first (padding rows read slot 0: outputs zeroed, nothing written).
        st = gl.allocate_shared_memory(gl.float32, [NC, BP, NS], SW)
        pc = p0 + gl.arange(0, BP, layout=gl.SliceLayout(1, LCP))
        nc = gl.arange(0, NS, layout=gl.SliceLayout(0, LCP))
        tile = gl.expand_dims(pc, 1) * N + gl.expand_dims(nc, 0)
        for c in gl.static_range(NC):
            cp.async_copy_global_to_shared(st.index(c), state_ptr + sbase + c * NS + tile)
            cp.commit_group()

        # 2. Decays over the history followed by the step's tokens: position kk < h_c is history row
        # (o + kk) % R, h_c <= kk < h_c + Q is token kk - h_c; one cumulative sum gives every Λ.
        kk = gl.arange(0, KB, layout=gl.SliceLayout(0, LY))
        hist = kk < hc
        A = gl.load(A_ptr + h)
        bias = gl.load(dt_bias_ptr + h)
        dtk = _delta(kk, hc, o, R, Q, valid, rdt_ptr, xrow0, dt_ptr, i, sdt_b, sdt_t, sdt_h, h, bias,
                     DT_SOFTPLUS)
        # Λ by a masked (KB, KB) sum whose rows are the positions summed: Δ loaded again in that layout,
        # so no layout conversion sits on the path.
        m = gl.arange(0, KB, layout=gl.SliceLayout(1, LY))
        dtm = _delta(m, hc, o, R, Q, valid, rdt_ptr, xrow0, dt_ptr, i, sdt_b, sdt_t, sdt_h, h, bias,
                     DT_SOFTPLUS)
        cum = gl.sum(gl.where(gl.expand_dims(m, 1) <= gl.expand_dims(kk, 0), gl.expand_dims(dtm, 1), 0.0),
                     axis=0) * A
        lam_h = gl.sum(gl.where(hist, dtk, 0.0), axis=0) * A
        t = gl.arange(0, QB, layout=gl.SliceLayout(1, LY))
        at_t = gl.expand_dims(kk, 0) == gl.expand_dims(hc + t, 1)  # (QB, KB): token t's own position
        cum_t = gl.sum(gl.where(at_t, gl.expand_dims(cum, 0), 0.0), axis=1)
        dt_t = gl.sum(gl.where(at_t, gl.expand_dims(dtk, 0), 0.0), axis=1)

        bs = gl.allocate_shared_memory(rB_ptr.dtype.element_ty, [KB, N], SR)
        xs = gl.allocate_shared_memory(gl.float32, [KB, BP], SR)
        if MMA == 2:  # C·B and w·x on tensor cores too, in the accumulator layout LM (16 padded tokens)
            DA16: gl.constexpr = gl.DotOperandLayout(0, LM, 2)
            DB16: gl.constexpr = gl.DotOperandLayout(1, LM, 2)
            km = gl.arange(0, KB, layout=gl.SliceLayout(0, LM))
            mm = gl.arange(0, KB, layout=gl.SliceLayout(1, LM))
            dk_m = _delta(km, hc, o, R, Q, valid, rdt_ptr, xrow0, dt_ptr, i, sdt_b, sdt_t, sdt_h, h, bias,
                          DT_SOFTPLUS)
            dm_m = _delta(mm, hc, o, R, Q, valid, rdt_ptr, xrow0, dt_ptr, i, sdt_b, sdt_t, sdt_h, h, bias,
                          DT_SOFTPLUS)
            cum_m = gl.sum(gl.where(gl.expand_dims(mm, 1) <= gl.expand_dims(km, 0), gl.expand_dims(dm_m, 1),
                                    0.0), axis=0) * A
            t16 = gl.arange(0, 16, layout=gl.SliceLayout(1, LM))
            at16 = gl.expand_dims(km, 0) == gl.expand_dims(hc + t16, 1)
            cum_t16 = gl.sum(gl.where(at16, gl.expand_dims(cum_m, 0), 0.0), axis=1)
            ta = gl.arange(0, 16, layout=gl.SliceLayout(1, DA16))
            na = gl.arange(0, NS, layout=gl.SliceLayout(0, DA16))
            c16 = C_ptr + i * sC_b + gl.expand_dims(ta, 1) * sC_t + g * sC_g + gl.expand_dims(na, 0)
            c16m = gl.expand_dims(ta < Q, 1)
            nbm = gl.arange(0, NS, layout=gl.SliceLayout(1, DB16))
            kbm = gl.arange(0, KB, layout=gl.SliceLayout(0, DB16))
            hbm = gl.expand_dims(kbm < hc, 0)
            wbm = gl.expand_dims((kbm >= hc) & (kbm < hc + Q), 0)
            bh16 = rB_ptr + gl.expand_dims((Brow0 + (o + kbm) % R) * N, 0) + gl.expand_dims(nbm, 1)
            bn16 = B_ptr + i * sB_b + gl.expand_dims((kbm - hc) * sB_t, 0) + g * sB_g + gl.expand_dims(nbm, 1)
            cb_m = gl.zeros([16, KB], gl.float32, LM)
            for c in gl.static_range(NC):
                Bb = gl.where(hbm, gl.load(bh16 + c * NS, mask=hbm, other=0.0),
                              gl.load(bn16 + c * NS, mask=wbm, other=0.0))  # (NS, KB), 16-bit: exact products
                cb_m = mma_v2(gl.load(c16 + c * NS, mask=c16m, other=0.0), Bb, cb_m)
            causal_m = gl.expand_dims(km, 0) <= gl.expand_dims(hc + t16, 1)
            w_m = gl.where(causal_m, gl.expand_dims(dk_m, 0) * cb_m
                           * gl.exp(gl.minimum(gl.expand_dims(cum_t16, 1) - gl.expand_dims(cum_m, 0), 0.0)),
                           0.0)
            DX: gl.constexpr = gl.DotOperandLayout(1, LM, 1)
            kxm = gl.arange(0, KB, layout=gl.SliceLayout(1, DX))
            pxm = p0 + gl.arange(0, BP, layout=gl.SliceLayout(0, DX))
            hxm = gl.expand_dims(kxm < hc, 1)
            nxm = gl.expand_dims((kxm >= hc) & (kxm < hc + Q), 1)
            Xb = gl.where(hxm, gl.load(rx_ptr + gl.expand_dims((xrow0 + (o + kxm) % R) * P, 1)
                                       + gl.expand_dims(pxm, 0), mask=hxm, other=0.0),
                          gl.load(x_ptr + i * sx_b + gl.expand_dims((kxm - hc) * sx_t, 1) + h * sx_h
                                  + gl.expand_dims(pxm, 0), mask=nxm, other=0.0)).to(gl.float32)
            y_m = mma_v2(gl.convert_layout(w_m, gl.DotOperandLayout(0, LM, 1)), Xb,
                         gl.zeros([16, BP], gl.float32, LM), input_precision="tf32")
            if flush:  # the fold's operands in shared memory, as the CUDA-core form keeps them
                LX2: gl.constexpr = gl.SliceLayout(0, LX)
                kx = gl.arange(0, KB, layout=gl.SliceLayout(1, LX2))
                px = p0 + gl.arange(0, BP, layout=gl.SliceLayout(0, LX2))
                xh = gl.load(rx_ptr + gl.expand_dims((xrow0 + (o + kx) % R) * P, 1) + gl.expand_dims(px, 0),
                             mask=gl.expand_dims(kx < hc, 1), other=0.0).to(gl.float32)
                mx = gl.arange(0, KB, layout=gl.SliceLayout(0, LX2))
                dx = _delta(kx, hc, o, R, Q, valid, rdt_ptr, xrow0, dt_ptr, i, sdt_b, sdt_t, sdt_h, h, bias,
                            DT_SOFTPLUS)
                dmx = _delta(mx, hc, o, R, Q, valid, rdt_ptr, xrow0, dt_ptr, i, sdt_b, sdt_t, sdt_h, h, bias,
                             DT_SOFTPLUS)
                cx = gl.sum(gl.where(gl.expand_dims(mx, 0) <= gl.expand_dims(kx, 1), gl.expand_dims(dmx, 0),
                                     0.0), axis=1) * A
                f = gl.where(kx < hc, dx * gl.exp(gl.minimum(lam_h - cx, 0.0)), 0.0)
                xs.store(xh * gl.expand_dims(f, 1))
                kb = gl.arange(0, KB, layout=gl.SliceLayout(1, LS))
                nb = gl.arange(0, NS, layout=gl.SliceLayout(0, LS))
                hb = gl.expand_dims(kb < hc, 1)
                bh_rows = rB_ptr + gl.expand_dims((Brow0 + (o + kb) % R) * N, 1) + gl.expand_dims(nb, 0)
                for c in gl.static_range(NC):
                    bs.slice(c * NS, NS, dim=1).store(gl.load(bh_rows + c * NS, mask=hb, other=0.0))
            gl.thread_barrier()
        else:
            # C·B of each token with each position (B rows from the ring or the step), in NS-column chunks.
            tq = gl.arange(0, QB, layout=gl.SliceLayout(1, LC))
            nq = gl.arange(0, NS, layout=gl.SliceLayout(0, LC))
            crow = C_ptr + i * sC_b + gl.expand_dims(tq, 1) * sC_t + g * sC_g + gl.expand_dims(nq, 0)
            cmask = gl.expand_dims(tq < Q, 1)
            kb = gl.arange(0, KB, layout=gl.SliceLayout(1, LS))
            nb = gl.arange(0, NS, layout=gl.SliceLayout(0, LS))
            hb = gl.expand_dims(kb < hc, 1)
            wb = gl.expand_dims((kb >= hc) & (kb < hc + Q), 1)
            bh_rows = rB_ptr + gl.expand_dims((Brow0 + (o + kb) % R) * N, 1) + gl.expand_dims(nb, 0)
            bn_rows = (B_ptr + i * sB_b + gl.expand_dims((kb - hc) * sB_t, 1) + g * sB_g
                       + gl.expand_dims(nb, 0))
            # A flush row keeps its history's B rows and f_j x_j in shared memory for the fold.
            cb = gl.zeros([QB, KB], gl.float32, LY)
            for c in gl.static_range(NC):
                Cc = gl.load(crow + c * NS, mask=cmask, other=0.0).to(gl.float32)
                Bh_raw = gl.load(bh_rows + c * NS, mask=hb, other=0.0)
                if flush:
                    bs.slice(c * NS, NS, dim=1).store(Bh_raw)
                Bn = gl.load(bn_rows + c * NS, mask=wb, other=0.0).to(gl.float32)
                Bc = gl.where(hb, Bh_raw.to(gl.float32), Bn)
                cb += gl.sum(gl.expand_dims(Cc, 1) * gl.expand_dims(Bc, 0), axis=2)
            causal = gl.expand_dims(kk, 0) <= gl.expand_dims(hc + t, 1)
            decays = gl.exp(gl.minimum(gl.expand_dims(cum_t, 1) - gl.expand_dims(cum, 0), 0.0))
            w = gl.where(causal, gl.expand_dims(dtk, 0) * decays * cb, 0.0)

            # Σ_k w_tk x_k over the same positions: x rows from the ring or the step as (KB, P), 4 columns a
            # thread (16-bit x: 8-byte loads), reduced over KB in LX.
            LX2: gl.constexpr = gl.SliceLayout(0, LX)
            kx = gl.arange(0, KB, layout=gl.SliceLayout(1, LX2))
            px = p0 + gl.arange(0, BP, layout=gl.SliceLayout(0, LX2))
            hx = gl.expand_dims(kx < hc, 1)
            nx = gl.expand_dims((kx >= hc) & (kx < hc + Q), 1)
            xh = gl.load(rx_ptr + gl.expand_dims((xrow0 + (o + kx) % R) * P, 1) + gl.expand_dims(px, 0),
                         mask=hx,
                         other=0.0).to(gl.float32)
            xn = gl.load(x_ptr + i * sx_b + gl.expand_dims((kx - hc) * sx_t, 1) + h * sx_h
                         + gl.expand_dims(px, 0), mask=nx, other=0.0).to(gl.float32)
            X = gl.where(hx, xh, xn)  # (KB, BP)
            wx = gl.convert_layout(w, gl.SliceLayout(2, LX))
            y = gl.convert_layout(gl.sum(gl.expand_dims(wx, 2) * gl.expand_dims(X, 0), axis=1), LY)
            if flush:  # fold coefficients f_j = Δ_j e^{Λ_h - Λ_j} on the history's x rows, Λ formed in LX2
                mx = gl.arange(0, KB, layout=gl.SliceLayout(0, LX2))
                dx = _delta(kx, hc, o, R, Q, valid, rdt_ptr, xrow0, dt_ptr, i, sdt_b, sdt_t, sdt_h, h, bias,
                            DT_SOFTPLUS)
                dmx = _delta(mx, hc, o, R, Q, valid, rdt_ptr, xrow0, dt_ptr, i, sdt_b, sdt_t, sdt_h, h, bias,
                             DT_SOFTPLUS)
                cx = gl.sum(gl.where(gl.expand_dims(mx, 0) <= gl.expand_dims(kx, 1), gl.expand_dims(dmx, 0),
                                     0.0), axis=1) * A
                f = gl.where(kx < hc, dx * gl.exp(gl.minimum(lam_h - cx, 0.0)), 0.0)
                xs.store(xh * gl.expand_dims(f, 1))
            gl.thread_barrier()
        # 3. C S0ᵀ from shared memory, chunk by chunk; a flush row folds each chunk from the same copy.
        cp.wait_group(0)
        acc = gl.zeros([QB, BP], gl.float32, LY)
        if MMA:
            acc_m = gl.zeros([16, BP], gl.float32, LM)
            ta = gl.arange(0, 16, layout=gl.SliceLayout(1, gl.DotOperandLayout(0, LM, 1)))
            na = gl.arange(0, NS, layout=gl.SliceLayout(0, gl.DotOperandLayout(0, LM, 1)))
            cm_rows = C_ptr + i * sC_b + gl.expand_dims(ta, 1) * sC_t + g * sC_g + gl.expand_dims(na, 0)
            cm_mask = gl.expand_dims(ta < Q, 1)
        decay = gl.exp(lam_h)
        for c in gl.static_range(NC):
            if MMA:  # C S0ᵀ on tensor cores: (16, NS) x (NS, BP) TF32 passes (C is exact in TF32)
                Sb = st.index(c).permute([1, 0]).load(gl.DotOperandLayout(1, LM, 1))
                Ca = gl.load(cm_rows + c * NS, mask=cm_mask, other=0.0).to(gl.float32)
                if OUT16:  # one pass where y is 16-bit (as `tf32.dot_out`)
                    acc_m = mma_v2(Ca, Sb, acc_m, input_precision="tf32")
                else:  # hi and lo of the state (as `tf32.dot_split`)
                    hi = (Sb.to(gl.uint32, bitcast=True) & 0xFFFFE000).to(gl.float32, bitcast=True)
                    acc_m = mma_v2(Ca, Sb - hi, mma_v2(Ca, hi, acc_m, input_precision="tf32"),
                                   input_precision="tf32")
            else:
                S = st.index(c).load(LS)
                Cc = gl.load(crow + c * NS, mask=cmask, other=0.0).to(gl.float32)
                acc += gl.sum(gl.expand_dims(Cc, 1) * gl.expand_dims(S, 0), axis=2)
            if flush:
                Sf = st.index(c).load(gl.SliceLayout(1, LF)) * decay
                for jc in gl.static_range(HB // JC):
                    xf = xs.permute([1, 0]).slice(jc * JC, JC, dim=1).load(gl.SliceLayout(2, LF))  # (BP, JC)
                    bj = bs.slice(jc * JC, JC, dim=0).slice(c * NS, NS, dim=1).load(gl.SliceLayout(0, LF))
                    Sf += gl.sum(gl.expand_dims(xf, 2) * gl.expand_dims(bj.to(gl.float32), 0), axis=1)
                pf = p0 + gl.arange(0, BP, layout=gl.SliceLayout(1, gl.SliceLayout(1, LF)))
                nf = gl.arange(0, NS, layout=gl.SliceLayout(0, gl.SliceLayout(1, LF)))
                gl.store(state_ptr + sbase + gl.expand_dims(pf, 1) * N + c * NS + gl.expand_dims(nf, 0), Sf)

        if MMA:  # the QB real token rows of the padded product, through shared memory
            ys = gl.allocate_shared_memory(gl.float32, [16, BP], SR)
            if MMA == 2:
                ys.store(gl.expand_dims(gl.exp(cum_t16), 1) * acc_m + y_m)
            else:
                ys.store(acc_m)
            gl.thread_barrier()
            acc = ys.slice(0, QB, dim=0).load(LY)
        # y_t = e^{Λ_t} C_t S0ᵀ + Σ_k w_tk x_k + D x_t; then the ring appends.
        py = p0 + gl.arange(0, BP, layout=gl.SliceLayout(0, LY))
        tmask = gl.expand_dims(t < Q, 1)
        xt_raw = gl.load(x_ptr + i * sx_b + gl.expand_dims(t * sx_t, 1) + h * sx_h + gl.expand_dims(py, 0),
                         mask=tmask, other=0.0)
        if MMA == 2:
            y = acc + gl.load(D_ptr + h) * xt_raw.to(gl.float32)
        else:
            y = gl.expand_dims(gl.exp(cum_t), 1) * acc + y + gl.load(D_ptr + h) * xt_raw.to(gl.float32)
        y = gl.where(valid, y, 0.0)
        gl.store(y_ptr + i * sy_b + gl.expand_dims(t * sy_t, 1) + h * sy_h + gl.expand_dims(py, 0),
                 y.to(y_ptr.dtype.element_ty), mask=tmask)
        if valid:
            arow = (o + hc + t) % R
            xa = rx_ptr + gl.expand_dims((xrow0 + arow) * P, 1) + gl.expand_dims(py, 0)
            gl.store(xa, xt_raw, mask=tmask)
            gl.store(rdt_ptr + xrow0 + arow, dt_t, mask=(t < Q) & (pid_p == 0))
            if (h % hpg == 0) & (pid_p == 0):
                nn = gl.arange(0, N, layout=gl.SliceLayout(0, LY))
                nmask = tmask & gl.expand_dims(nn < N, 0)
                Bt = gl.load(B_ptr + i * sB_b + gl.expand_dims(t * sB_t, 1) + g * sB_g
                             + gl.expand_dims(nn, 0), mask=nmask, other=0.0)
                Ba = rB_ptr + gl.expand_dims((Brow0 + arow) * N, 1) + gl.expand_dims(nn, 0)
                gl.store(Ba, Bt, mask=nmask)


def layouts(QB: int, num_warps: int = NUM_WARPS) -> dict:
    """The kernel's layouts for QB padded tokens: one 3-D blocked layout whose slices carry every
    product ((QB, P, NS) for C S0ᵀ, (QB, KB, NS) for C·B, (QB, P, KB) for w·x; 8 columns a thread, 4
    threads a row), the copies' coalesced layout and the shared-memory layouts (the state chunks
    swizzled by 16-byte vectors, so a warp's reads of 8-column runs hit distinct banks)."""
    return dict(
        L3=gl.BlockedLayout([QB, 1, 8], [1, 8, 4], [1, num_warps, 1], [2, 1, 0]),
        LX=gl.BlockedLayout([QB, 4, 4], [1, 8, 4], [1, 1, num_warps], [2, 1, 0]),
        LF=gl.BlockedLayout([1, 4, 8], [8, 1, 4], [num_warps, 1, 1], [2, 1, 0]), JC=4,
        LCP=gl.BlockedLayout([1, 4], [4, 8], [num_warps, 1], [1, 0]),
        SW=gl.SwizzledSharedLayout(4, 1, 8, [1, 0]),
        SR=gl.SwizzledSharedLayout(1, 1, 1, [1, 0]),
        LM=gl.NVMMADistributedLayout([2, 0], [1, num_warps], [16, 8]),
    )


def launch_mono_g(x, dt, A, B, C, D, dt_bias, state, ring_x, ring_B, ring_dt, ring_start, committed,
                  state_indices, window, dt_softplus, y, block_p: int = 64, num_warps: int = NUM_WARPS,
                  order: bool = False, mma: bool = False) -> None:
    """One launch, grid (1, H, b) (2b with `order`: the flush rows' programs first). fp32 state, N a
    multiple of 32, P a multiple of 32; the window at most 32 - q positions with the step's tokens."""
    S, H, P, N = state.shape
    b, q = x.shape[:2]
    G, R = B.shape[2], ring_x.shape[2]
    if gluon is None:
        raise ValueError("route 'mono.g' needs Triton with Gluon (triton.experimental.gluon)")
    if state.dtype != torch.float32:
        raise ValueError(f"route 'mono.g' folds fp32 state pools only (got {state.dtype})")
    if N % 32 or P % block_p or block_p % 16:
        raise ValueError(f"route 'mono.g' needs N a multiple of 32 and a tile of a multiple of 16 rows "
                         f"dividing P (P={P}, N={N}, block_p={block_p})")
    HB = triton.next_power_of_2(int(window))
    KB = max(32, triton.next_power_of_2(int(window) + q))
    QB = triton.next_power_of_2(q)
    _mono_g_kernel[(P // block_p, H, b * (1 + order))](
        x, dt, A, B, C, D, dt_bias, state, ring_x, ring_B, ring_dt, ring_start, committed, state_indices, y,
        int(window), *x.stride()[:3], *dt.stride(), *B.stride()[:3], *C.stride()[:3], *y.stride()[:3],
        H, G, R,
        Q=q, QB=QB, HB=HB, KB=KB, P=P, N=N, BP=block_p, NS=32, DT_SOFTPLUS=bool(dt_softplus),
        ORDER=bool(order), MMA=(1 + (x.dtype != torch.float32)) if mma else 0,
        OUT16=y.dtype != torch.float32, num_warps=num_warps,
        **layouts(QB, num_warps),
    )  # fmt: skip
