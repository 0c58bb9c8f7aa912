"""Commands around the picker that ship with it: `picker doctor` and `picker explain`. (`picker demo`, `picker sim`
and `picker bench` are the lab's, lab/picker_lab, a distribution of its own.)

May import everything; nothing but the command line imports it.
"""
