output "autoscaling_group_name" {
  description = "Name of the pool's Auto Scaling group (instances carry it as tag aws:autoscaling:groupName)."
  value       = aws_autoscaling_group.this.name
}

output "autoscaling_group_arn" {
  description = "ARN of the pool's Auto Scaling group."
  value       = aws_autoscaling_group.this.arn
}

output "launch_template_id" {
  description = "ID of the pool's launch template."
  value       = aws_launch_template.this.id
}

output "ami_id" {
  description = "AMI the pool's nodes boot."
  value       = local.ami_id
}

output "iam_role_name" {
  description = "Name of the nodes' IAM role (checkpoint bucket access only)."
  value       = aws_iam_role.this.name
}

output "iam_instance_profile_arn" {
  description = "ARN of the nodes' instance profile."
  value       = aws_iam_instance_profile.this.arn
}
