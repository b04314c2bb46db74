"""Parallelism applied to a plain model from outside (torchtitan style): device layer, meshes, TP, PP, DP.

The model in ``engine.model`` never sees a rank; everything that knows about devices and process groups lives here.
"""
