#!/usr/bin/env bash
# Bring FA4-CuTe (flash-attn-4's sm_90 path, the benchmark's `fa4cute` peer column) onto the device
# in three calls: the wheels are ~98 MB and a device call carries at most 64 MiB, working tree
# included (~12.3 MiB on 2026-12-04; the two-call recipe of .whl-fa4/small with part ab, ~63.7 MiB,
# no longer fits). Wheels come from /work/shared/tools/fa4_peer/fetch.sh, run once on the CPU machine
# from the checkout's root:
#     bash ../shared/tools/fa4_peer/fetch.sh .whl-fa4      # and: echo /.whl-fa4/ >> .git/info/exclude
# (.whl-fa4 must be in the checkout the device call sends: the lead's, not a helper's worktree.)
#
# The calls follow each other at once (a warm machine keeps /tmp between calls; an idle one is
# given back after about 30 s and the next starts with an empty /tmp):
#   1. carry [".whl-fa4/parts/libs_cu13.part.aa"]            (46.0 MiB + tree)
#      command: bash scripts/fa4_peer.sh stage1
#   2. carry [".whl-fa4/small"]                               (9.7 MiB + tree)
#      command: bash scripts/fa4_peer.sh stage1b
#   3. carry [".whl-fa4/parts/libs_cu13.part.ab", ".whl-fa4/parts/NAME"]   (41.7 MiB + tree)
#      command: bash scripts/fa4_peer.sh stage2 && bash scripts/gpu_check.sh   (or any bench)
# stage1 / stage1b copy what they are given into $FA4_DIR. stage2 joins the two parts into the libs
# wheel, unpacks every wheel (the small ones from the checkout when carried, else from stage1b's copy)
# into $FA4_DIR/site with `python3 -m zipfile -e` (not `pip install --target`: that replaces the
# shared nvidia_cutlass_dsl/ folder wheel by wheel), lists what is there and, unless
# FA4_PEER_NO_IMPORT=1, imports flash_attn.cute.interface once (no GPU work) to show the peer is
# usable. bench/attention.py then finds $FA4_DIR/site on its own (or wherever FA4_PEER_SITE points).
#
#     bash scripts/fa4_peer.sh stage1|stage1b|stage2|status
# Environment: FA4_DIR (default /tmp/fa4), FA4_WHEELS (default .whl-fa4 in the checkout's root),
# PYTHON (default python3). Every stage is idempotent: rerunning one redoes nothing already done.
set -euo pipefail
cd "$(dirname "$0")/.."
FA4_DIR="${FA4_DIR:-/tmp/fa4}"
WHEELS="${FA4_WHEELS:-.whl-fa4}"
PY="${PYTHON:-python3}"
PART_A=libs_cu13.part.aa
PART_B=libs_cu13.part.ab
say() { printf 'fa4_peer: %s\n' "$*"; }
die() { printf 'fa4_peer: %s\n' "$*" >&2; exit 1; }

stage1() {
    local src="$WHEELS/parts/$PART_A"
    mkdir -p "$FA4_DIR"
    if [ -s "$FA4_DIR/$PART_A" ] && { [ ! -f "$src" ] || cmp -s "$src" "$FA4_DIR/$PART_A"; }; then
        say "stage1: $FA4_DIR/$PART_A already there ($(stat -c %s "$FA4_DIR/$PART_A") bytes)"
        return 0
    fi
    [ -f "$src" ] || die "stage1: $src is missing: carry [\".whl-fa4/parts/$PART_A\"] in this call (wheels: bash ../shared/tools/fa4_peer/fetch.sh .whl-fa4 on the CPU machine)"
    cp "$src" "$FA4_DIR/$PART_A.tmp" && mv "$FA4_DIR/$PART_A.tmp" "$FA4_DIR/$PART_A"
    say "stage1: copied $src -> $FA4_DIR/$PART_A ($(stat -c %s "$FA4_DIR/$PART_A") bytes); now call 2: bash scripts/fa4_peer.sh stage1b"
}

stage1b() {
    local smalls=("$WHEELS"/small/*.whl) w
    [ -e "${smalls[0]}" ] || die "stage1b: no wheels in $WHEELS/small: carry [\".whl-fa4/small\"] in this call"
    mkdir -p "$FA4_DIR/small"
    for w in "${smalls[@]}"; do
        if ! cmp -s "$w" "$FA4_DIR/small/$(basename "$w")"; then
            cp "$w" "$FA4_DIR/small/$(basename "$w").tmp" && mv "$FA4_DIR/small/$(basename "$w").tmp" "$FA4_DIR/small/$(basename "$w")"
        fi
    done
    say "stage1b: $FA4_DIR/small holds ${#smalls[@]} wheel(s); now call 3: bash scripts/fa4_peer.sh stage2"
}

stage2() {
    local site="$FA4_DIR/site" name wheel w
    [ -f "$WHEELS/parts/NAME" ] || die "stage2: $WHEELS/parts/NAME is missing: carry [\".whl-fa4/small\", \".whl-fa4/parts/$PART_B\", \".whl-fa4/parts/NAME\"] in this call"
    name="$(tr -d '[:space:]' < "$WHEELS/parts/NAME")"
    wheel="$FA4_DIR/$name"
    if [ -s "$wheel" ] && "$PY" -m zipfile -t "$wheel" >/dev/null 2>&1; then
        say "stage2: $wheel already joined"
    else
        [ -s "$FA4_DIR/$PART_A" ] || die "stage2: $FA4_DIR/$PART_A is missing: run call 1 (bash scripts/fa4_peer.sh stage1, carry [\".whl-fa4/parts/$PART_A\"]) right before this one (a machine that went idle in between starts with an empty /tmp)"
        [ -f "$WHEELS/parts/$PART_B" ] || die "stage2: $WHEELS/parts/$PART_B is missing: carry it in this call"
        cat "$FA4_DIR/$PART_A" "$WHEELS/parts/$PART_B" > "$wheel.tmp"
        "$PY" -m zipfile -t "$wheel.tmp" >/dev/null || { rm -f "$wheel.tmp"; die "stage2: $PART_A + $PART_B do not join into a valid wheel (parts from different fetches?)"; }
        mv "$wheel.tmp" "$wheel"
        say "stage2: joined $wheel ($(stat -c %s "$wheel") bytes)"
    fi
    local smalls=("$WHEELS"/small/*.whl)
    [ -e "${smalls[0]}" ] || smalls=("$FA4_DIR"/small/*.whl)  # stage1b's copy
    [ -e "${smalls[0]}" ] || die "stage2: no wheels in $WHEELS/small nor $FA4_DIR/small: run stage1b (carry [\".whl-fa4/small\"]) right before this call"
    mkdir -p "$site/.fa4_peer_unpacked"
    for w in "${smalls[@]}" "$wheel"; do
        local stamp="$site/.fa4_peer_unpacked/$(basename "$w")"
        if [ -f "$stamp" ]; then
            continue
        fi
        "$PY" -m zipfile -e "$w" "$site" || die "stage2: unpacking $w failed"
        touch "$stamp"
        say "stage2: unpacked $(basename "$w")"
    done
    # zipfile -e drops the mode bits: give back the execute bit to shipped tools (e.g. a ptxas)
    find "$site" -path '*/bin/*' -type f -exec chmod +x {} + 2>/dev/null || true
    status
    if [ "${FA4_PEER_NO_IMPORT:-0}" != 1 ]; then
        FA4_PEER_SITE="$site" "$PY" - <<'EOF' || die "stage2: the site is unpacked but flash_attn.cute.interface does not import (see above)"
import os, site, sys, time
site.addsitedir(os.environ["FA4_PEER_SITE"])
t0 = time.perf_counter()
from flash_attn.cute.interface import flash_attn_func  # noqa: F401
print(f"fa4_peer: stage2: flash_attn.cute.interface imports ({time.perf_counter() - t0:.1f} s)")
EOF
    fi
}

status() {
    local site="$FA4_DIR/site"
    [ -d "$site" ] || { say "status: no $site (run stage1, then stage2)"; return 1; }
    say "status: $site holds:"
    (cd "$site" && ls -1 | sed 's/^/    /')
    ls "$site"/*.dist-info >/dev/null 2>&1 && for d in "$site"/*.dist-info; do
        printf '    %s %s\n' "$(sed -n 's/^Name: //p' "$d/METADATA" | head -n 1)" "$(sed -n 's/^Version: //p' "$d/METADATA" | head -n 1)"
    done
    say "status: $(du -sh "$site" | cut -f1) in $site"
}

case "${1:-}" in
    stage1) stage1 ;;
    stage1b) stage1b ;;
    stage2) stage2 ;;
    status) status ;;
    *) die "usage: bash scripts/fa4_peer.sh stage1|stage1b|stage2|status (see the header for the device calls' carry lists)" ;;
esac
