"""The host pool and its plan: the pool a server calls, the slots it hands out, how its bytes are laid out and
bound to the device pool's, the layer ids it takes, a call's indices checked and converted (the one room for
index checks), its events, its drop word and the errors a transfer raises.
"""
