cluster_name = "train-a"
vpc_cidr     = "10.42.0.0/16"
admin_cidrs  = ["203.0.113.0/24"]
pools = {
  a100 = { instance_type = "p4d.24xlarge", count = 2, gpus_per_node = 8 }
  spot = { instance_type = "g5.12xlarge", count = 1, gpus_per_node = 4, capacity_type = "spot" }
}
node_addresses = {
  "train-a-head"    = "10.42.0.10"
  "train-a-a100-00" = "10.42.1.11"
  "train-a-a100-01" = "10.42.1.12"
  "train-a-spot-00" = "10.42.2.13"
}
head_public_address = "198.51.100.20"
checkpoint_bucket   = "train-a-checkpoints"
shared_filesystem   = { type = "efs", source = "fs-0123456789abcdef0.efs.us-east-1.amazonaws.com" }
