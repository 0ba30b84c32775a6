"""What a verifier runs: batch building, the model runner, the generation loop."""
