//! The decode step's kernel math on plain slices. The eager runs' kernels capture the step's
//! token and position; the captured graph's kernels read them from a device buffer at every
//! launch. Both call these functions, so every run computes the same tokens.

use soma::hal::KernelError;

use super::{FFN, HEADS, HEAD_DIM, HIDDEN};

/// The embedding of `token` (a deterministic pattern: the weights are never read).
pub(super) fn embed(token: u32, x: &mut [f32]) {
    for (i, v) in x.iter_mut().enumerate() {
        *v = ((token as usize * 31 + i * 7) % 97) as f32 / 97.0 - 0.5;
    }
}

/// `o = x / rms(x)`.
pub(super) fn rms_norm(x: &[f32], o: &mut [f32]) {
    let rms = (x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32 + 1e-6).sqrt();
    for (o, x) in o.iter_mut().zip(x) {
        *o = x / rms;
    }
}

/// The q, k and v projections of layer `salt`.
pub(super) fn qkv(h: &[f32], q: &mut [f32], k: &mut [f32], v: &mut [f32], salt: f32) {
    for i in 0..HIDDEN {
        q[i] = h[i] * (0.9 + salt);
        k[i] = h[(i + 1) % HIDDEN] * (1.1 - salt);
        v[i] = h[(i + 7) % HIDDEN] + salt;
    }
}

/// Writes `k` and `v` into row `row` of the caches.
pub(super) fn kv_append(
    k: &[f32],
    v: &[f32],
    ck: &mut [f32],
    cv: &mut [f32],
    row: usize,
) -> Result<(), KernelError> {
    let rows = row * HIDDEN..(row + 1) * HIDDEN;
    ck.get_mut(rows.clone()).ok_or_else(|| KernelError::new("kv row"))?.copy_from_slice(k);
    cv.get_mut(rows).ok_or_else(|| KernelError::new("kv row"))?.copy_from_slice(v);
    Ok(())
}

/// Attention scores of `seq` cached tokens: `sc[head * seq + t]`.
pub(super) fn scores(q: &[f32], ck: &[f32], sc: &mut [f32], seq: usize) {
    let scale = 1.0 / (HEAD_DIM as f32).sqrt();
    for hd in 0..HEADS {
        let qh = &q[hd * HEAD_DIM..(hd + 1) * HEAD_DIM];
        for t in 0..seq {
            let kh = &ck[t * HIDDEN + hd * HEAD_DIM..t * HIDDEN + (hd + 1) * HEAD_DIM];
            sc[hd * seq + t] = qh.iter().zip(kh).map(|(a, b)| a * b).sum::<f32>() * scale;
        }
    }
}

/// Each head's row of `seq` scores, normalised into probabilities.
pub(super) fn softmax(sc: &[f32], p: &mut [f32], seq: usize) {
    for hd in 0..HEADS {
        let row = &sc[hd * seq..(hd + 1) * seq];
        let max = row.iter().copied().fold(f32::MIN, f32::max);
        let sum: f32 = row.iter().map(|v| (v - max).exp()).sum();
        for t in 0..seq {
            p[hd * seq + t] = (row[t] - max).exp() / sum;
        }
    }
}

/// The attention output: the cached values weighted by `p`.
pub(super) fn attn_v(p: &[f32], cv: &[f32], out: &mut [f32], seq: usize) {
    out.fill(0.0);
    for hd in 0..HEADS {
        for t in 0..seq {
            let w = p[hd * seq + t];
            let vh = &cv[t * HIDDEN + hd * HEAD_DIM..t * HIDDEN + (hd + 1) * HEAD_DIM];
            for (o, v) in out[hd * HEAD_DIM..(hd + 1) * HEAD_DIM].iter_mut().zip(vh) {
                *o += w * v;
            }
        }
    }
}

/// The output projection.
pub(super) fn o_proj(attn: &[f32], o: &mut [f32]) {
    for (o, x) in o.iter_mut().zip(attn) {
        *o = x * 0.5;
    }
}

/// `o = x + y` (the residual connections).
pub(super) fn add(x: &[f32], y: &[f32], o: &mut [f32]) {
    for i in 0..o.len() {
        o[i] = x[i] + y[i];
    }
}

/// The feed-forward gate and up projections.
pub(super) fn gate_up(h: &[f32], g: &mut [f32], u: &mut [f32]) {
    for i in 0..FFN {
        g[i] = h[i % HIDDEN] * 1.5;
        u[i] = h[(i * 3) % HIDDEN] * 0.7;
    }
}

/// `silu(g) * u`.
pub(super) fn silu_mul(g: &[f32], u: &[f32], out: &mut [f32]) {
    for i in 0..FFN {
        out[i] = g[i] / (1.0 + (-g[i]).exp()) * u[i];
    }
}

/// The feed-forward down projection.
pub(super) fn down(act: &[f32], d: &mut [f32]) {
    d.fill(0.0);
    for (i, v) in act.iter().enumerate() {
        d[i % HIDDEN] += v * 0.1;
    }
}

/// The logits over the vocabulary.
pub(super) fn lm_head(h: &[f32], l: &mut [f32]) {
    for (i, v) in l.iter_mut().enumerate() {
        *v = h[i % HIDDEN] * ((i % 13) as f32 - 6.0) + h[(i * 5) % HIDDEN];
    }
}

/// The index of the largest logit (the first of equals).
pub(super) fn argmax(l: &[f32]) -> u32 {
    l.iter().enumerate().fold((0, f32::MIN), |acc, (i, &v)| if v > acc.1 { (i, v) } else { acc }).0
        as u32
}
