"""Server side of the server/client design (reward-model and critic servers, rollout router)."""
