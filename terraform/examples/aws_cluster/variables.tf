################################################################################
# Cluster
################################################################################

variable "region" {
  description = "AWS region of the cluster."
  type        = string
  default     = "us-east-1"
  nullable    = false
}

variable "azs" {
  description = "Availability zones (the first one hosts the GPU pools, which share a cluster placement group); null uses the region's first two."
  type        = list(string)
  default     = null
}

variable "cluster_name" {
  description = "Name of the cluster (DNS-safe; validated by cluster_spec)."
  type        = string
  default     = "train-a"
  nullable    = false
}

variable "vpc_cidr" {
  description = "IPv4 CIDR of the cluster VPC (/16 to /24)."
  type        = string
  default     = "10.42.0.0/16"
  nullable    = false
}

variable "admin_cidrs" {
  description = "CIDRs allowed to SSH to the head node and open its dashboards, e.g. [\"203.0.113.7/32\"] (your address). Never 0.0.0.0/0."
  type        = list(string)
  nullable    = false
}

variable "ssh_key_name" {
  description = "Existing EC2 key pair that Ansible logs in with (its private key must be in your ssh-agent)."
  type        = string
  nullable    = false
}

################################################################################
# Nodes
################################################################################

variable "head_instance_type" {
  description = "CPU instance type of the Ray head node (also runs Prometheus, Grafana and MLflow)."
  type        = string
  default     = "m6i.2xlarge"
  nullable    = false
}

variable "pools" {
  description = "GPU worker pools keyed by name; see terraform/modules/cluster_spec (instance_type, count 1-32, gpus_per_node 1-8, capacity_type on_demand|spot, ray_resources)."
  type = map(object({
    instance_type = string
    count         = number
    gpus_per_node = number
    capacity_type = optional(string, "on_demand")
    ray_resources = optional(map(number), {})
  }))
  default = {
    a10g = { instance_type = "g5.12xlarge", count = 2, gpus_per_node = 4 }
  }
  nullable = false
}

variable "ami_id" {
  description = "AMI of every node; null uses the AWS Deep Learning Base GPU AMI (Ubuntu 22.04) from its public SSM parameter."
  type        = string
  default     = null
}

################################################################################
# Storage
################################################################################

variable "checkpoint_bucket_name" {
  description = "Name of the checkpoint bucket; null derives <cluster_name>-checkpoints-<account id>."
  type        = string
  default     = null
}

variable "create_fsx_lustre" {
  description = "Also create an FSx for Lustre file system (mounted instead of EFS)."
  type        = bool
  default     = false
  nullable    = false
}

variable "tags" {
  description = "Tags added to every resource."
  type        = map(string)
  default     = {}
  nullable    = false
}
