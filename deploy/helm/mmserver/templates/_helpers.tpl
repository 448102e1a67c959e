{{/* Names, labels and the values every template derives from the same place. */}}

{{- define "mmserver.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's prefix of every object; 52 characters at most, so that the names derived
from it ("-management", "-headless", the StatefulSet's controller-revision-hash label on its
pods) stay within Kubernetes' 63. */}}
{{- define "mmserver.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "mmserver.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "mmserver.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The mmserver pods (component "server"); the balancer's are "balancer". */}}
{{- define "mmserver.selectorLabels" -}}
app.kubernetes.io/name: {{ include "mmserver.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: server
{{- end }}

{{- define "mmserver.balancerSelectorLabels" -}}
app.kubernetes.io/name: {{ include "mmserver.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: balancer
{{- end }}

{{/* The headless Service that names every pod: the StatefulSet's serviceName, what HAProxy
resolves, and what the ServiceMonitor scrapes. */}}
{{- define "mmserver.headlessName" -}}
{{- printf "%s-headless" (include "mmserver.fullname" .) }}
{{- end }}

{{- define "mmserver.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "mmserver.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The Secret holding the management token, and its key. */}}
{{- define "mmserver.tokenSecretName" -}}
{{- if .Values.managementToken.existingSecret }}
{{- .Values.managementToken.existingSecret }}
{{- else }}
{{- printf "%s-management" (include "mmserver.fullname" .) }}
{{- end }}
{{- end }}

{{- define "mmserver.tokenSecretKey" -}}
{{- if .Values.managementToken.existingSecret }}
{{- .Values.managementToken.existingSecretKey }}
{{- else }}
{{- "token" }}
{{- end }}
{{- end }}

{{/* A value as an environment variable's text: a whole number stays whole (YAML numbers
reach templates as floats, which would print 10485760 as 1.048576e+07). */}}
{{- define "mmserver.envValue" -}}
{{- if and (kindIs "float64" .) (eq . (floor .)) }}
{{- int64 . | toString }}
{{- else }}
{{- toString . }}
{{- end }}
{{- end }}

{{/* An emptyDir volume source, with its size limit when one is given. */}}
{{- define "mmserver.emptyDir" -}}
{{- if . }}{{ dict "sizeLimit" (toString .) | toJson }}{{ else }}{}{{ end }}
{{- end }}

{{/* Seconds the server's pods get to stop: the preStop pause, the drain (drain_timeout,
rounded up) and the margin for stopping the backends and flushing the logs. Derived from
server.drainTimeout, so that the grace period always outlasts the drain. */}}
{{- define "mmserver.gracePeriod" -}}
{{- $v := .Values.server }}
{{- add (int $v.preStopSeconds) (int (ceil $v.drainTimeout)) (int $v.shutdownMarginSeconds) }}
{{- end }}

{{/* HAProxy's soft stop lasts at most its hard-stop-after (40 s, as mmserver cluster's). */}}
{{- define "mmserver.haproxyHardStopAfter" -}}40{{- end }}

{{- define "mmserver.haproxyGracePeriod" -}}
{{- add (int .Values.haproxy.preStopSeconds) (int (include "mmserver.haproxyHardStopAfter" .)) 5 }}
{{- end }}

{{/* "true" when an autoscaler (the HPA or KEDA's) owns the StatefulSet's replicas. */}}
{{- define "mmserver.autoscaled" -}}
{{- if or .Values.autoscaling.hpa.enabled .Values.autoscaling.keda.enabled }}true{{ end }}
{{- end }}

{{/* The most pods the StatefulSet has: replicas, or the autoscaler's maxReplicas. */}}
{{- define "mmserver.maxPods" -}}
{{- if include "mmserver.autoscaled" . }}{{ int .Values.autoscaling.maxReplicas }}{{ else }}{{ int .Values.replicas }}{{ end }}
{{- end }}

{{/* HAProxy's servers: one for each pod name from -0 on, haproxy.servers of them at least, and
at least as many as the StatefulSet may have pods. */}}
{{- define "mmserver.haproxyServers" -}}
{{- max (int .Values.haproxy.servers) (int (include "mmserver.maxPods" .)) }}
{{- end }}

{{/* The pods' topologySpreadConstraints: one per topology key, preferred (ScheduleAnyway: a pod
is scheduled even where it cannot spread), then the ones given whole. Takes a dict: spread (the
values' topologySpread), extra (topologySpreadConstraints), selector (the pods' labels). */}}
{{- define "mmserver.topologySpread" -}}
{{- $constraints := list }}
{{- range .spread.topologyKeys }}
{{- $selector := dict "matchLabels" ($.selector | fromYaml) }}
{{- $constraints = append $constraints (dict "maxSkew" (int $.spread.maxSkew) "topologyKey" . "whenUnsatisfiable" "ScheduleAnyway" "labelSelector" $selector) }}
{{- end }}
{{- $constraints = concat $constraints (.extra | default list) }}
{{- with $constraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* The PromQL query of the queued requests of every pod of the release together (KEDA
divides it by the pods it counts): autoscaling.keda.query, or the gauge mmserver_queue_length
averaged over a minute, summed over the StatefulSet's pods by the labels a ServiceMonitor's
scrape gives them. */}}
{{- define "mmserver.kedaQuery" -}}
{{- $pods := printf "%s-[0-9]+" (include "mmserver.fullname" .) }}
{{- .Values.autoscaling.keda.query | default (printf "sum(avg_over_time(mmserver_queue_length{namespace=%q, pod=~%q}[1m]))" .Release.Namespace $pods) }}
{{- end }}

{{/* A PodDisruptionBudget's bound given (0 is one; "" and null are not). */}}
{{- define "mmserver.isSet" -}}
{{- if not (or (kindIs "invalid" .) (eq (toString .) "")) }}true{{ end }}
{{- end }}

{{/* A count or a percentage, as Kubernetes' IntOrString takes it. */}}
{{- define "mmserver.intOrPercent" -}}
{{- if kindIs "string" . }}{{ . | quote }}{{ else }}{{ int . }}{{ end }}
{{- end }}

{{/* Options the chart sets itself, from values of their own: server.options may not set them. */}}
{{- define "mmserver.reservedOptions" -}}
host: "the pods listen on 0.0.0.0"
port: server.port
grpc_port: server.grpcPort
drain_timeout: server.drainTimeout
model_store: modelStore
cache_dir: "the cache volume at /cache"
max_memory_mb: server.maxMemoryMb
management_token: managementToken
insecure_management: managementToken.insecure
{{- end }}

{{/* Refuse at install what the server would refuse at start, or run badly with. */}}
{{- define "mmserver.validate" -}}
{{- $reserved := include "mmserver.reservedOptions" . | fromYaml }}
{{- range $name, $_ := .Values.server.options }}
{{- if hasKey $reserved $name }}
{{- fail (printf "server.options.%s: set it through %s" $name (get $reserved $name)) }}
{{- end }}
{{- if not (regexMatch "^[a-z][a-z0-9_]*$" $name) }}
{{- fail (printf "server.options.%s: an option's name is lower case with underscores (max_loaded_models)" $name) }}
{{- end }}
{{- end }}
{{- with .Values.managementToken }}
{{- if not (or .existingSecret .value .insecure) }}
{{- fail "managementToken: the pods listen on 0.0.0.0, where mmserver refuses to start without a management token: set managementToken.existingSecret (a Secret you made) or managementToken.value (the chart makes the Secret), or managementToken.insecure=true to leave the management calls open" }}
{{- end }}
{{- if and .existingSecret .value }}
{{- fail "managementToken: set existingSecret or value, not both" }}
{{- end }}
{{- end }}
{{- $limits := .Values.resources.limits | default dict }}
{{- if not (or $limits.memory .Values.server.maxMemoryMb) }}
{{- fail "resources.limits.memory: the model memory budget comes from the container's memory limit; without one, set server.maxMemoryMb (or the budget would be 80% of the node's available memory)" }}
{{- end }}
{{- with .Values.modelStore }}
{{- if and (eq .type "persistentVolumeClaim") (not .persistentVolumeClaim.claimName) }}
{{- fail "modelStore.persistentVolumeClaim.claimName: the claim holding the model store (ReadOnlyMany or ReadWriteMany for several pods)" }}
{{- end }}
{{- if and (eq .type "hostPath") (not .hostPath.path) }}
{{- fail "modelStore.hostPath.path: the node's directory holding the model store" }}
{{- end }}
{{- if and (eq .type "s3") (not (hasPrefix "s3://" .s3.url)) }}
{{- fail "modelStore.s3.url: s3://bucket/prefix of the models' NAME.tar.gz objects" }}
{{- end }}
{{- end }}
{{- if eq (int .Values.server.grpcPort) (int .Values.server.port) }}
{{- fail "server.grpcPort: must differ from server.port (0 = no gRPC)" }}
{{- end }}
{{- if and .Values.haproxy.enabled (eq .Values.haproxy.port (.Values.haproxy.statsPort)) }}
{{- fail "haproxy.statsPort: must differ from haproxy.port" }}
{{- end }}
{{- if .Values.state.enabled }}
{{- range $name := list "state_dir" "warm_ready_timeout" }}
{{- if hasKey ($.Values.server.options | default dict) $name }}
{{- fail (printf "server.options.%s: with state.enabled the chart sets it (state.warmReadyTimeout; the state volume at /state)" $name) }}
{{- end }}
{{- end }}
{{- end }}
{{- with .Values.autoscaling }}
{{- if and .hpa.enabled .keda.enabled }}
{{- fail "autoscaling: hpa.enabled and keda.enabled are both set; two autoscalers would fight over the StatefulSet's replicas (KEDA makes an HPA of its own): turn one off" }}
{{- end }}
{{- if gt (int .minReplicas) (int .maxReplicas) }}
{{- fail (printf "autoscaling.minReplicas (%d) is more than autoscaling.maxReplicas (%d)" (int .minReplicas) (int .maxReplicas)) }}
{{- end }}
{{- if and .keda.enabled (not .keda.serverAddress) }}
{{- fail "autoscaling.keda.serverAddress: the Prometheus KEDA asks for the queued requests (http://prometheus-operated.monitoring.svc:9090, for example)" }}
{{- end }}
{{- end }}
{{- if .Values.autoscaling.hpa.enabled }}
{{- $requests := .Values.resources.requests | default dict }}
{{- if not $requests.cpu }}
{{- fail "resources.requests.cpu: the HPA's target is a percentage of the pods' CPU request; set one" }}
{{- end }}
{{- end }}
{{- with .Values.podDisruptionBudget }}
{{- if .enabled }}
{{- $max := include "mmserver.isSet" .maxUnavailable }}
{{- $min := include "mmserver.isSet" .minAvailable }}
{{- if and $max $min }}
{{- fail "podDisruptionBudget: set maxUnavailable or minAvailable, not both (maxUnavailable: \"\" to use minAvailable)" }}
{{- end }}
{{- if not (or $max $min) }}
{{- fail "podDisruptionBudget: set maxUnavailable or minAvailable (or enabled: false)" }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
