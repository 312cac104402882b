"""The project's own VLM data and model: scenes of easy-vqa shapes with grounded descriptions (`dataset`) and the
scenes VLM assembled from SmolLM2 and a shipped vision tower (`vlm`)."""
