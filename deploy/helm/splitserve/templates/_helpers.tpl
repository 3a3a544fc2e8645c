{{/*
Names, labels and small values shared by every template.
Names are DNS-1123 labels truncated to 63 characters; user labels never go into
selectors (a selector is immutable, so it must not change on upgrade).
*/}}

{{- define "splitserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "splitserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* "<fullname>-<suffix>", still at most 63 characters. */}}
{{- define "splitserve.componentName" -}}
{{- $full := include "splitserve.fullname" .root -}}
{{- printf "%s-%s" ($full | trunc (int (sub 62 (len .component))) | trimSuffix "-") .component -}}
{{- end -}}

{{- define "splitserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Selector labels of one component: stable across upgrades. */}}
{{- define "splitserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "splitserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Full labels of one component's objects. */}}
{{- define "splitserve.labels" -}}
{{ include "splitserve.selectorLabels" . }}
helm.sh/chart: {{ include "splitserve.chart" .root }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: splitserve
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "splitserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- /* The image's vLLM flavour (the workers of engine: vllm pools): image.vllmTag, else "<tag>-vllm". */ -}}
{{- define "splitserve.vllmImage" -}}
{{- printf "%s:%s" .Values.image.repository (default (printf "%s-vllm" (default .Chart.AppVersion .Values.image.tag)) .Values.image.vllmTag) -}}
{{- end -}}

{{- define "splitserve.operator.serviceAccountName" -}}
{{- if .Values.operator.serviceAccount.create -}}
{{- default (include "splitserve.componentName" (dict "root" . "component" "operator")) .Values.operator.serviceAccount.name -}}
{{- else -}}
{{- required "operator.serviceAccount.name must be set when operator.serviceAccount.create is false" .Values.operator.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The etcd endpoint(s) workers and frontends register with, comma-separated. */}}
{{- define "splitserve.etcdEndpoints" -}}
{{- if .Values.etcd.external.endpoints -}}
{{- join "," .Values.etcd.external.endpoints -}}
{{- else if .Values.etcd.enabled -}}
{{- printf "%s://%s.%s.svc:%d" (ternary "https" "http" .Values.etcd.tls.enabled) (include "splitserve.componentName" (dict "root" . "component" "etcd")) .Release.Namespace (int .Values.etcd.clientPort) -}}
{{- else -}}
{{- fail "etcd: set etcd.enabled=true or etcd.external.endpoints (workers need an etcd for discovery)" -}}
{{- end -}}
{{- end -}}

{{/* Pod selector terms of ServingDeployment workloads (labels the operator sets). */}}
{{- define "splitserve.workerSelector" -}}
matchExpressions:
  - key: splitserve.io/role
    operator: In
    values: [prefill, decode]
{{- end -}}

{{- define "splitserve.frontendSelector" -}}
matchLabels:
  splitserve.io/role: frontend
{{- end -}}

{{- define "splitserve.scrapeAnnotations" -}}
{{- if .root.Values.monitoring.scrapeAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end -}}

{{/* What the operator does to the workloads it owns (README: RBAC table). */}}
{{- define "splitserve.operator.workloadRules" -}}
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch, create, delete, patch]
- apiGroups: [""]
  resources: [pods/binding]
  verbs: [create]
- apiGroups: [""]
  resources: [pods/status]
  verbs: [patch]
- apiGroups: [""]
  resources: [services, configmaps]
  verbs: [get, list, watch, create, update, patch, delete]
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch]
- apiGroups: [events.k8s.io]
  resources: [events]
  verbs: [create, patch]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, update, patch, delete]
- apiGroups: [splitserve.io]
  resources: [servingdeployments]
  verbs: [get, list, watch, patch, update]
- apiGroups: [splitserve.io]
  resources: [servingdeployments/status, servingdeployments/scale]
  verbs: [get, patch, update]
# ServingPool: the per-pool child that makes each pool `kubectl scale`-able. Its
# deletion is left to the garbage collector (owner references): no delete.
- apiGroups: [splitserve.io]
  resources: [servingpools]
  verbs: [get, list, watch, create, patch, update]
- apiGroups: [splitserve.io]
  resources: [servingpools/status]
  verbs: [get, patch, update]
# spec.autoscaling: the planner's counts go through each pool's scale subresource.
- apiGroups: [splitserve.io]
  resources: [servingpools/scale]
  verbs: [get, patch]
{{- end -}}

{{/*
The gateway switch (gateway.enabled, issue 40): the InferencePool and its endpoint picker.
The EPP's ports are fixed: they are `splitserve epp`'s flags, the Service's ports and the
InferencePool's endpointPickerRef at once.
*/}}
{{- define "splitserve.gateway.deployment" -}}
{{- required "gateway.deployment must be set when gateway.enabled is true: the name of the ServingDeployment whose pods form the InferencePool" .Values.gateway.deployment -}}
{{- end -}}

{{- define "splitserve.gateway.poolName" -}}
{{- default (include "splitserve.gateway.deployment" .) .Values.gateway.poolName -}}
{{- end -}}

{{- define "splitserve.epp.name" -}}
{{- include "splitserve.componentName" (dict "root" . "component" "epp") -}}
{{- end -}}

{{- define "splitserve.epp.grpcPort" -}}9002{{- end -}}
{{- define "splitserve.epp.healthPort" -}}9003{{- end -}}
{{- define "splitserve.epp.metricsPort" -}}9090{{- end -}}

{{/* The EPP's pods, as NetworkPolicies select them. */}}
{{- define "splitserve.eppSelector" -}}
matchLabels:
  splitserve.io/role: epp
{{- end -}}
