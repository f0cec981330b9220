"""Example fabrics, the example scheduler and the demand trace; the economics demo's inputs
are installed as `trellis.examples` (setup.py maps this folder into the package)."""
