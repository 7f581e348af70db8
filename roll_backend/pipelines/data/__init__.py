"""What a run trains on: prompt datasets and mixtures, their rows and checks, offline datasets (SFT, RM, DPO), and the
synthetic and procedural tasks generated without files."""
