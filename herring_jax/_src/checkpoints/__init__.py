"""Checkpoints of sharded training and when to save them: save_sharded / restore_sharded, their
files and the ranks' agreement on a step, and the preemption agreement.
"""
