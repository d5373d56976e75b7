#!/usr/bin/env bash
# On the GPU machine: ncu of fa4gen's sm_90a kernel and FA4-CuTe's at one dense shape, non-causal and
# causal, and the side-by-side report of bench.ncu_compare (warp states per issued instruction, pipe
# activity, per-opcode stall samples). FA4-CuTe must be staged first (scripts/fa4_peer.sh, three
# calls); without it only fa4gen is profiled.
#   bash scripts/ncu_sm90_vs_peer.sh [B,S,Hq,Hkv,D]        (default 2,8192,16,16,64)
# Writes to $OUT (default ./ncu_out): ncu_<shape>.tgz (each kernel's details / raw / sass CSV exports
# and logs) and report_<shape>[_causal].txt. About 45 s per kernel (ncu --set full, one launch;
# --clock-control none, as the lent machines ask). Environment: PYTHON (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
SHAPE="${1:-2,8192,16,16,64}"
PY="${PYTHON:-python3}"
OUTDIR="${OUT:-$PWD/ncu_out}"
mkdir -p "$OUTDIR"
command -v ncu >/dev/null || { echo "ncu_sm90_vs_peer: no ncu on PATH" >&2; exit 2; }
W="$(mktemp -d /tmp/ncu_cmp.XXXXXX)"
tag_shape="${SHAPE//,/x}"
peers=(fa4gen)
if "$PY" -c "from bench.attention import load_fa4cute; import sys; sys.exit(0 if load_fa4cute()[0] else 1)" 2>/dev/null; then
    peers+=(fa4cute)
else
    echo "ncu_sm90_vs_peer: FA4-CuTe not staged (bash scripts/fa4_peer.sh stage1 / stage1b / stage2): fa4gen alone"
fi
for causal in "" "--causal"; do
    raws=() sasses=() ok=()
    for who in "${peers[@]}"; do
        peer=""; [ "$who" = fa4cute ] && peer="--peer fa4cute"
        tag="${who}${causal:+_causal}"
        if ! timeout 240 ncu --clock-control none --kernel-name regex:"fa4_fwd|[Ff]lash" --launch-skip 1 --launch-count 1 \
                --set full --import-source no -f -o "$W/$tag" \
                "$PY" -m bench.profile_sm90 "$SHAPE" $peer $causal > "$W/$tag.log" 2>&1; then
            echo "ncu_sm90_vs_peer: ncu of $tag failed:"; tail -5 "$W/$tag.log"; continue
        fi
        ncu --import "$W/$tag.ncu-rep" --page details --csv > "$W/${tag}_details.csv"
        ncu --import "$W/$tag.ncu-rep" --page raw --csv > "$W/${tag}_raw.csv"
        ncu --import "$W/$tag.ncu-rep" --page source --csv --print-source sass > "$W/${tag}_sass.csv"
        raws+=("$W/${tag}_raw.csv"); sasses+=("$W/${tag}_sass.csv"); ok+=("$who")
    done
    [ ${#raws[@]} -gt 0 ] || continue
    names="$(printf '%s,' "${ok[@]}")"
    "$PY" -m bench.ncu_compare "${raws[@]}" --sass "${sasses[@]}" --names "${names%,}" \
        --out "$OUTDIR/report_${tag_shape}${causal:+_causal}.txt"
done
(cd "$W" && tar czf "$OUTDIR/ncu_${tag_shape}.tgz" ./*.csv ./*.log 2>/dev/null)
ls -la "$OUTDIR"
