"""tools/sass_loops.py's loop finder on a hand-written SASS listing (the tool itself needs a compile)."""

from __future__ import annotations

from tools.sass_loops import loops

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   IMAD R2, R3, R4, RZ ;
        /*0020*/              @!P0 FMUL R5, R5, R6 ;
        /*0030*/                   IMAD.WIDE.U32 R6, R7, R8, RZ ;
        /*0040*/               @P1 BRA `(.L_x_0) ;
        /*0050*/                   BRA `(.L_x_1) ;
.L_x_1:
        /*0060*/                   EXIT ;
"""


def test_a_backward_branch_is_a_loop_and_a_forward_one_is_not() -> None:
    # the body from the label to the branch back, predicates and opcode suffixes dropped from the counts
    assert loops(SASS) == [(4, {"IMAD": 2, "FMUL": 1, "BRA": 1})]
