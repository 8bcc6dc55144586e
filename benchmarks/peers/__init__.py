"""The peers (FlashMLA, DeepGEMM): their build scripts and the `peers` bench group."""
