"""Commands around the picker: `picker demo`, `picker doctor`, `picker explain` and the echo backend the tests and
demo use. (`picker sim` and `picker bench` are the `sim` and `bench` packages, in the same layer.)

May import everything; nothing but the command line imports it.
"""
