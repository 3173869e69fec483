"""The launcher side of ftrun: launcher, supervisors, zygotes, coordination through the control store."""
