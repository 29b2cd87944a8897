"""What is declared as data: the host layouts, the pool kinds, and the layout oracles the kit checks them against.
"""
