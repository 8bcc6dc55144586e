#!/usr/bin/env bash
# Twenty-sixth session, call 2 (H200). HHH v2: call 1 measured v1 (f16 partials stored from
# registers) slower; now each warpgroup stages its f16 partial in its Q half of shared memory
# and stores it by TMA, and the merge reads 64-column blocks of f16. "mosaic-lib-half" beside
# the library's default ("mosaic-lib"), each checked against the jnp twin with the derived
# bound on every check case, then timed at 64x1 (2 splits a row) and decode-b1's one row (33
# splits); the two diagnostics again as a same-run reference.
set -o pipefail
export PYTHONUNBUFFERED=1
mkdir -p $OUT
export PYTHONPATH=.
timeout 280 python3 benchmarks/h200_attend.py --groups mosaic-all --shapes ad --limit-s 270 --base mosaic-lib --variants mosaic-lib-half,diag-noload,diag-nostore --out $OUT/h200-attend.json 2>&1 | tail -30
