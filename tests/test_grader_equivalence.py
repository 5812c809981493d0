"""grader/equivalence.py: whether a predicted answer equals the gold, through reward.grade: the
normalization, number, symbolic, equation, tuple, set and interval rules, multiple choice, several
answers, one box per part.
"""
import pytest

import reward


# ==================================================================================================
# grader/equivalence.py: equality of an answer and its gold
# ==================================================================================================
@pytest.mark.parametrize("pred, gold, expected", [
    # normalization rules
    ("\\dfrac{3}{4}", "\\frac{3}{4}", True), ("\\tfrac34", "0.75", True),
    ("{3 \\over 4}", "\\frac34", True),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})", True),
    ("\\bigl(2\\bigr)", "2", True),
    ("\\; 7 \\;", "7", True), ("\\sqrt{\\,2\\,}", "\\sqrt2", True),
    ("\\displaystyle \\frac{3}{4}", "0.75", True),
    ("5\\text{ cm}^2", "5", True), ("10 \\, \\text{km}", "10", True), ("42 dollars", "42", True),
    ("30^\\circ", "30", True), ("120°", "120", True), ("45 \\text{ degrees}", "45", True),
    ("25\\%", "25", True), ("25 \\text{ percent}", "25\\%", True), ("50\\%", "\\frac12", True),
    ("1.5\\%", "15", False),
    ("\\$1,\\!250", "1250", True), ("1{,}000", "1000", True), ("1\\;000", "1000", True),
    ("10,080", "10,\\!080", True),
    ("x = 5", "5", True), ("5", "x=5", True), ("f(x) = x^2", "x^2", True), ("k=4", "4", True),
    ("x=-5", "x=5", False),
    ("33", "033", True), ("7", "007", True), ("1011", "1011_2", True), ("213_{4}", "213_4", True),
    ("\\text{Yes}", "\\text{yes}", True), ("\\text{yes}", "\\text{no}", False),
    ("\\textbf{(C) }12", "C", True),
    ("\\text{(D)}", "D", True), ("(B)", "C", False), ("\\mathbf{5}", "5", True),
    ("\\mathbf{\\frac{1}{2}}", "0.5", True), ("{100^\\circ}", "100", True),
    ("{\\text{Tuesday}}", "\\text{Tuesday}", True),
    # exact numbers
    ("\\frac{6}{8}", "\\frac34", True), ("0.875", "\\frac{7}{8}", True), (".125", "\\frac18", True),
    ("3.50", "3.5", True), ("64.00", "64", True), ("2\\frac{1}{3}", "\\frac73", True),
    ("1", "2\\frac12", False),
    ("3.2 \\times 10^5", "320000", True), ("3.2e5", "3.2 \\times 10^5", True),
    ("2 \\times 10^{6}", "2 \\times 10^{-6}", False), ("\\frac{1}{1000}", "\\frac{1}{999}", False),
    ("10^{18}", "10^{18}+1", False), ("\\frac{1}{2006!}", "\\frac{1}{2004!}", False),
    ("0.0011", "0.001", False), ("0.0000002", "0.0000001", False), ("12.5", "12", False),
    ("- 5", "-5", True),
    ("\\frac{1}{-2}", "-\\frac12", True), ("(-2)", "-2", True), ("3!", "6", True),
    ("2^8", "256", True),
    ("0.1\\overline{6}", "\\frac16", True),
    # decimal golds: tolerance only for an exact-form prediction of a rounded gold
    ("0.67", "\\frac23", False), ("0.333", "\\frac13", False), ("3.464", "2\\sqrt3", False),
    ("1.5708", "\\frac{\\pi}{2}", False), ("\\frac{\\pi}{2}", "1.5708", True),
    ("\\frac13", "0.33", True),
    ("\\frac13", "0.3", False), ("0.333", "0.33", False),
    ("27", "27.0", True), ("27.04", "27.0", False),
    # symbolic
    ("\\sqrt{18}", "3\\sqrt2", True), ("\\frac{1}{2-\\sqrt3}", "2+\\sqrt3", True),
    ("2^{1/3}", "\\sqrt[3]{2}", True),
    ("4\\sqrt(2)", "4", False), ("\\frac{4\\pi}{3}", "\\frac43\\pi", True),
    ("16-8\\pi", "8\\pi-16", False),
    ("4i+3", "3+4i", True), ("3-4i", "3+4i", False), ("|3+4i|", "5", True),
    ("\\left| -3 \\right|", "3", True),
    ("2\\sin x \\cos x", "\\sin 2x", True), ("(e^x)^2", "e^{2x}", True),
    ("\\frac{\\ln 3}{\\ln 2}", "\\log_2 3", True),
    ("\\ln 2 + \\ln 3", "\\ln 6", True), ("-10-4(n-5)", "10-4n", True), ("q - p", "p - q", False),
    ("x^2+2x-1", "x^2+2x+1", False), ("\\frac{9a + 11}{20}", "\\frac{11+9a}{20}", True),
    # equations and relations
    ("y = 3 + 2x", "y=2x+3", True), ("2x+4y-3=0", "y=-\\frac{1}{2}x+\\frac{3}{4}", True),
    ("3x-y+13=0", "3x+4y+14=0", False), ("x = 2 + 3 = 5", "5", True),
    ("\\frac{6}{8} = \\frac{3}{4}", "0.75", True),
    ("x = 5\\sqrt{2} \\approx 7.07", "5\\sqrt2", True), ("7.07", "5\\sqrt2", False),
    ("5 > x", "x<5", True), ("a>2", "a \\geq 2", False), ("2x < y", "y > 2x", True),
    # tuples, sets, intervals, matrices, several answers
    ("(2,1)", "(1,2)", False), ("(4,5,6)", "(4, 5)", False),
    ("(0.5, 4)", "(\\frac{1}{2}, 4)", True),
    ("\\{3,2,1\\}", "\\{1,2,3\\}", True), ("\\{1,2,3,4\\}", "\\{1,3\\} \\cup \\{2,4\\}", True),
    ("\\{1,2,3,4\\}", "\\{1,2,3\\}", False), ("\\varnothing", "\\emptyset", True),
    ("[3, \\infty)", "x \\ge 3", True), ("(2,5)", "[2,5)", False), ("(2,5]", "[2,5)", False),
    ("x<3", "(-\\infty,3)", True),
    ("(3,\\infty)\\cup(-\\infty,-2)", "(-\\infty,-2)\\cup(3,\\infty)", True),
    ("0 < x < 12.5", "(0, 12.5)", True),
    ("m \\in [\\sqrt{2}, +\\infty)", "m \\geq \\sqrt{2}", True),
    ("x \\ne 1", "(-\\infty,1)\\cup(1,\\infty)", True),
    ("x \\le -1 \\text{ or } x \\ge 2", "(-\\infty,-1]\\cup[2,\\infty)", True),
    ("\\begin{bmatrix} 1 & 2 \\\\ 3 & 4 \\end{bmatrix}",
     "\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}", True),
    ("\\begin{pmatrix} 1 & 3 \\\\ 2 & 4 \\end{pmatrix}",
     "\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}", False),
    ("4, -1", "-1, 4", True), ("x = -2 \\text{ or } x = 1", "-2, 1", True),
    ("0 \\text{ and } 1", "0, 1", True),
    ("1, 2, 4", "1, 2, 4, 8", False), ("21, 36, and 82", "19, 46, \\text{ and } 82", False),
    ("x=3, y=4", "(3, 4)", True), ("\\pm 3", "3, -3", True), ("3", "\\pm 3", False),
    # hedges and empty answers
    ("3 \\text{ or } 4", "3", False), ("3 and 4", "4", False), ("3, 4", "3", False),
    ("", "3", False),
    (" ", "3", False), ("x+11 \\text{ or } 11+x", "11+x", True),  # one answer twice is no hedge
    ("12:00", "12:00", True), ("1:00", "12:00", False),
    # relations of one variable through an affine map or an absolute value;
    # a named quantity; \approx as the value
    ("-x > -1", "x<1", True), ("-x \\ge -1", "x \\le 1", True), ("-x < -1", "x<1", False),
    ("-x > -1", "x \\le 1", False),
    ("2x - 4 > 0", "x > 2", True), ("|x - 3| < 2", "(1, 5)", True),
    ("|x - 3| > 2", "(1, 5)", False),
    ("|x| > 2", "(-\\infty, -2) \\cup (2, \\infty)", True),
    ("1 \\le |z| \\le 3/2", "[-1.5,-1]\\cup[1,1.5]", True),
    ("1 \\le z \\le 3/2", "[-1.5,-1]\\cup[1,1.5]", False), ("0 < f(x) < 1", "(0, 1)", True),
    ("0 \\le f(x) < 1", "(0, 1)", False), ("x \\approx 11", "11", True),
    ("x \\approx 11.2", "11", False),
    ("x \\approx 0.33", "\\frac13", False), ("x^2 < 4", "(-2, 2)", False),
    ("\\pi \\approx 3.14", "\\pi", True),
    # labels that are not a plain variable; ratios term by term
    ("1", "|AB| = 1", True), ("|AB| = 1", "1", True), ("|AC| = 1", "|AB| = 1", False),
    ("2", "|AB| = 1", False),
    ("7:32", "S_{MBCN}:S = 7:32", True), ("7:23", "S_{MBCN}:S = 7:32", False),
    ("14:64", "7:32", False),
    ("\\frac{\\sqrt6}{6}", "\\frac{NO}{BO} = \\frac{1}{\\sqrt6}", True),
    ("\\frac16", "\\frac{NO}{BO} = \\frac{1}{\\sqrt6}", False),
    ("5", "x + y = 5", False), ("|x| = 5", "5", False),
    # number formats: a decimal comma where it cannot be a thousands separator (one-number gold)
    ("1000,99", "1000.99", True), ("2,74", "2.74", True), ("0,111", "0.111", True),
    ("1,500", "1.5", False),
    ("2,74", "2, 74", True), ("2.74", "2, 74", False), ("2, 74", "2.74", False),
    ("14 {, }916", "14916", True),
    ("185", "185\\ ", True), ("186", "185\\ ", False),
    # tuples with semicolons
    ("(0;0;0)", "(0,0,0)", True), ("(0;0;1)", "(0,0,0)", False), ("[1;2)", "[1,2)", True),
    # issue 53: a labelled angle, \bmod, a gold with its value on the left,
    # a left side that cannot be read, \\dfrac
    ("\\angle APC = 74^\\circ", "74^\\circ", True), ("\\angle APC = 75^\\circ", "74^\\circ", False),
    ("17 \\bmod 5", "2", True), ("17 \\bmod 5", "3", False), ("2", "2=x", True),
    ("3", "2=x", False),
    ("3", "3 = x + y", False), ("\\lim_{x \\to 0} \\frac{\\sin x}{x} = 1", "1", True),
    ("\\lim_{x \\to 0} \\frac{\\sin x}{x} = 1", "0", False), ("\\\\dfrac{1}{2}", "0.5", True),
    ("\\begin{vmatrix} 2 & 1 \\\\ 1 & 2 \\end{vmatrix} = 3", "3", True),
    ("6,8", "6 \\text{ and } 8", True),
    ("x \\geq 5", "5", False), ("x \\ne 3", "3", False), ("x < 3", "3", False),
])
def test_reward_equivalence_rules(pred, gold, expected):
    assert reward.grade(f"The answer is $\\boxed{{{pred}}}$.", gold) is expected


@pytest.mark.parametrize("pred, gold, expected", [
    ("E", "E", True), ("\\textbf{(C)}", "C", True), ("C", "\\textbf{(C)}", True), ("C)", "C", True),
    ("C", "C. x = 42", True), ("C. x = 42", "C. x = 42", True), ("x = 42", "C. x = 42", True),
    ("(C) 12", "C", True),
    ("C. x = 41", "C. x = 42", False), ("D", "C. x = 42", False), ("(C)\\ 13", "(C) 12", False),
    ("E+1", "E", False), ("E^2", "E", False), ("\\mathrm{E}*2", "E", False), ("A*3", "A", False),
    ("B = 7", "B", False),
    ("B \\text{ or } C", "B", False), ("B, C", "B", False), ("A B C D E", "A", False),
    ("ABCDE", "A", False),
    ("(C) \\text{ or } (D)", "C", False), ("(C)(D)", "C", False), ("C. D", "C", False),
    ("C.5", "C", False),
])
def test_reward_choice_gold_accepts_only_its_choice(pred, gold, expected):
    """A letter gold accepts that choice, alone or with its own label text; nothing with more math
    after the letter, no second choice (listing every choice was always right), no hedge."""
    assert reward.grade(f"The answer is $\\boxed{{{pred}}}$.", gold) is expected


def test_reward_list_golds_are_several_answers():
    assert reward.grade("\\boxed{84, 69}", ["$69$,$84$"])
    assert reward.grade("\\boxed{69 \\text{ and } 84}", ["$69$", "$84$"])
    assert not reward.grade("\\boxed{69}", ["$69$", "$84$"])
    assert reward.grade("\\boxed{\\sqrt{8}}", ["$2 \\sqrt{2}$"])
    assert reward.grade("\\boxed{x}", ["$f(x)=x$"])


def test_reward_several_boxes_for_several_parts():
    """A gold of k answers is also compared with the last k boxes (one box per part), unless one is
    hedged."""
    two = "For part (a) the point is $\\boxed{(3,3)}$, and for part (b) we get $\\boxed{(1,1)}$."
    assert reward.grade(two, "(3,3), (1,1)") and reward.grade(two, ["(1,1)", "(3,3)"])
    # one-answer gold: the last box
    assert not reward.grade(two, "(3,3)") and reward.grade(two, "(1,1)")
    # the last two boxes are not the answers
    assert not reward.grade(two + " Also $\\boxed{(2,2)}$.", "(3,3), (1,1)")
    assert not reward.grade("(a) $\\boxed{6}$. (b) $\\boxed{15}$ (or maybe 16)", ["6", "15"])
    assert not reward.grade("(a) $\\boxed{6}$ or possibly 7. (b) $\\boxed{15}$.", ["6", "15"])
    assert not reward.grade("(a) $\\boxed{}$. (b) $\\boxed{15}$.", ["6", "15"])
    # a retraction
    assert not reward.grade("So $\\boxed{3}$. Wait, that is wrong: actually $\\boxed{5}$.", "3, 5")
    # part (a) hedged
    assert not reward.grade("(a) $\\boxed{7}$ or $\\boxed{6}$. (b) $\\boxed{15}$.", ["6", "15"])
