"""Loads and the loader: the layer loader that submits a layer-wise load off the caller's thread (its streams,
events and the rule that keeps it deadlock-free), and the one door both adapters take to load several pools
layer by layer.
"""
