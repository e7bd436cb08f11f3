package main

import (
	"context"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/compose-spec/compose-go/v2/cli"
	"github.com/compose-spec/compose-go/v2/types"
	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"sigs.k8s.io/yaml"
)

// The deploy files are checked against the app's own defaults, so changing a
// default without the files (or the files without the code) fails here.

func TestDockerCompose(t *testing.T) {
	opts, err := cli.NewProjectOptions([]string{"docker-compose.yml"}, cli.WithWorkingDirectory("."), cli.WithName("kumiko"))
	if err != nil {
		t.Fatal(err)
	}
	project, err := opts.LoadProject(context.Background())
	if err != nil {
		t.Fatalf("compose-go cannot load docker-compose.yml: %v", err)
	}
	defaults := defaultConfig().Lifecycle
	ids := map[string]bool{}
	trusted := map[string][]netip.Prefix{}
	for _, name := range []string{"app1", "app2"} {
		app, err := project.GetService(name)
		if err != nil {
			t.Fatalf("no service %s: %v", name, err)
		}
		id := app.Environment["KUMIKO_INSTANCE_ID"]
		if id == nil || ids[*id] {
			t.Errorf("%s needs its own KUMIKO_INSTANCE_ID, got %v", name, id)
		} else {
			ids[*id] = true
		}
		if app.HealthCheck == nil || !strings.Contains(strings.Join(app.HealthCheck.Test, " "), "healthcheck") {
			t.Errorf("%s has no healthcheck through the binary: %+v", name, app.HealthCheck)
		}
		if app.StopGracePeriod == nil || time.Duration(*app.StopGracePeriod) <= defaults.ShutdownTimeout {
			t.Errorf("%s stop_grace_period %v must exceed the shutdown budget %s", name, app.StopGracePeriod, defaults.ShutdownTimeout)
		}
		for dep, cond := range app.DependsOn {
			if cond.Condition != types.ServiceConditionHealthy {
				t.Errorf("%s starts before %s is healthy (%s)", name, dep, cond.Condition)
			}
		}
		// The environment the container gets is a valid configuration.
		env := map[string]string{}
		for k, v := range app.Environment {
			if v != nil {
				env[k] = *v
			}
		}
		cfg, err := loadConfig(func(k string) string { return env[k] }, environOf(env), func(string) ([]byte, error) { return nil, os.ErrNotExist })
		if err != nil {
			t.Errorf("%s's environment is not a valid config: %v", name, err)
		} else if _, err := decodeMasterKey(cfg.MasterKey, "compose"); err != nil {
			t.Errorf("%s's master key: %v", name, err)
		}
		trusted[name] = cfg.HTTP.TrustedProxies
		// The ops port carries the demo's admin token: this machine only.
		for _, p := range app.Ports {
			if p.HostIP != "127.0.0.1" {
				t.Errorf("%s publishes port %d on %q, want 127.0.0.1 only", name, p.Target, p.HostIP)
			}
		}
	}
	for _, svc := range []string{"postgres", "redis", "meilisearch", "minio"} {
		if s, err := project.GetService(svc); err != nil || s.HealthCheck == nil {
			t.Errorf("service %s missing or without a healthcheck", svc)
		}
	}
	lb, err := project.GetService("lb")
	if err != nil {
		t.Fatal(err)
	}
	for _, app := range []string{"app1", "app2"} {
		if lb.DependsOn[app].Condition != types.ServiceConditionHealthy {
			t.Errorf("the load balancer does not wait for %s to be healthy", app)
		}
		// X-Forwarded-For is believed from the load balancer's own address, nothing more.
		var lbAddr string
		if n := lb.Networks["default"]; n != nil {
			lbAddr = n.Ipv4Address
		}
		if want := lbAddr + "/32"; lbAddr == "" || len(trusted[app]) != 1 || trusted[app][0].String() != want {
			t.Errorf("%s trusts X-Forwarded-For from %v, want the load balancer's fixed address alone (%s)", app, trusted[app], want)
		}
	}
	haproxy, _ := os.ReadFile("deploy/haproxy.cfg")
	_, opsPort, _ := net.SplitHostPort(defaultConfig().OpsAddr)
	for _, want := range []string{"option httpchk GET /health/ready", "server app1 app1:8080 check port " + opsPort, "server app2 app2:8080 check port " + opsPort} {
		if !strings.Contains(string(haproxy), want) {
			t.Errorf("deploy/haproxy.cfg lacks %q", want)
		}
	}
}

func TestKubernetesManifests(t *testing.T) {
	files, _ := filepath.Glob("k8s/*.yaml")
	var deploy *appsv1.Deployment
	var configMap *corev1.ConfigMap
	var service *corev1.Service
	kinds := map[string]bool{}
	for _, file := range files {
		if strings.HasSuffix(file, "prometheus-alerts.yaml") {
			continue // a Prometheus rule file, checked by TestAlertRulesUseRealMetrics
		}
		if strings.HasSuffix(file, "kustomization.yaml") {
			continue // the list of the above for `kubectl apply -k`, checked by TestKubernetesDevOverlay
		}
		raw, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		var meta struct{ Kind string }
		yaml.Unmarshal(raw, &meta)
		var obj any
		switch meta.Kind {
		case "Deployment":
			deploy = &appsv1.Deployment{}
			obj = deploy
		case "Service":
			service = &corev1.Service{}
			obj = service
		case "ConfigMap":
			configMap = &corev1.ConfigMap{}
			obj = configMap
		case "Secret":
			obj = &corev1.Secret{}
		case "PodDisruptionBudget":
			obj = &policyv1.PodDisruptionBudget{}
		case "Job":
			obj = &batchv1.Job{}
		default:
			t.Errorf("%s: unexpected kind %q", file, meta.Kind)
			continue
		}
		if err := yaml.UnmarshalStrict(raw, obj); err != nil {
			t.Errorf("%s does not decode strictly into %s: %v", file, meta.Kind, err)
		}
		kinds[meta.Kind] = true
	}
	for _, kind := range []string{"Deployment", "Service", "ConfigMap", "Secret", "PodDisruptionBudget", "Job"} {
		if !kinds[kind] {
			t.Errorf("no %s manifest", kind)
		}
	}
	if deploy == nil || configMap == nil || service == nil {
		t.FailNow()
	}
	// The ops port (probes, metrics, /admin, /debug/pprof) is reached per pod:
	// the kubelet and Prometheus go to the pod, an operator port-forwards.
	for _, p := range service.Spec.Ports {
		if p.Name != "http" {
			t.Errorf("the Service exposes port %s (%d); only the API belongs there", p.Name, p.Port)
		}
	}

	d := defaultConfig()
	spec := deploy.Spec
	// Service links would set variables named after the Service, under the service's own prefix.
	if links := spec.Template.Spec.EnableServiceLinks; links == nil || *links {
		t.Errorf("the Deployment keeps Kubernetes' service-link variables, which stop the boot (config.unknownEnv); set enableServiceLinks: false")
	}
	if *spec.Replicas != 2 || spec.Strategy.RollingUpdate.MaxUnavailable.IntValue() != 0 {
		t.Errorf("want 2 replicas and maxUnavailable 0")
	}
	c := spec.Template.Spec.Containers[0]
	ports := map[string]int32{}
	for _, p := range c.Ports {
		ports[p.Name] = p.ContainerPort
	}
	_, opsPort, _ := net.SplitHostPort(d.OpsAddr)
	_, httpPort, _ := net.SplitHostPort(d.HTTPAddr)
	if itoa(int64(ports["ops"])) != opsPort || itoa(int64(ports["http"])) != httpPort {
		t.Errorf("container ports %v do not match the app's %s and %s", ports, d.OpsAddr, d.HTTPAddr)
	}
	demoOff := false
	for _, e := range c.Env {
		demoOff = demoOff || (e.Name == "KUMIKO_DEMO_ENDPOINTS" && e.Value == "false")
	}
	if !demoOff {
		t.Errorf("the Deployment must set KUMIKO_DEMO_ENDPOINTS=false: /api/slow is a demo route")
	}
	for name, probe := range map[string]*corev1.Probe{"readiness": c.ReadinessProbe, "startup": c.StartupProbe, "liveness": c.LivenessProbe} {
		want := "/health/ready"
		if name == "liveness" {
			want = "/health"
		}
		if probe == nil || probe.HTTPGet.Path != want || probe.HTTPGet.Port.String() != "ops" {
			t.Errorf("%s probe %+v, want GET %s on the ops port", name, probe, want)
		}
	}
	if budget := time.Duration(c.StartupProbe.PeriodSeconds*c.StartupProbe.FailureThreshold) * time.Second; budget < d.Lifecycle.StartupTimeout {
		t.Errorf("the startup probe gives up after %s, before the boot budget %s", budget, d.Lifecycle.StartupTimeout)
	}
	grace := time.Duration(*spec.Template.Spec.TerminationGracePeriodSeconds) * time.Second
	if grace < d.Lifecycle.Linger+d.Lifecycle.DrainTimeout+5*time.Second || grace <= d.Lifecycle.ShutdownTimeout {
		t.Errorf("terminationGracePeriodSeconds %s must cover linger %s + drain %s + margin, and exceed the shutdown budget %s",
			grace, d.Lifecycle.Linger, d.Lifecycle.DrainTimeout, d.Lifecycle.ShutdownTimeout)
	}
	// A drain that went wrong leaves its files on a writable volume (the root
	// filesystem is read-only) and its summary where the kubelet reads it.
	env := map[string]string{}
	for _, e := range c.Env {
		env[e.Name] = e.Value
	}
	mounts := map[string]string{}
	for _, m := range c.VolumeMounts {
		mounts[m.MountPath] = m.Name
	}
	emptyDirs := map[string]*corev1.EmptyDirVolumeSource{}
	for _, v := range spec.Template.Spec.Volumes {
		if v.EmptyDir != nil {
			emptyDirs[v.Name] = v.EmptyDir
		}
	}
	diag := env["KUMIKO_DIAGNOSTICS_DIR"]
	if ed := emptyDirs[mounts[diag]]; diag == "" || ed == nil {
		t.Errorf("KUMIKO_DIAGNOSTICS_DIR %q is not an emptyDir mount (mounts %v)", diag, mounts)
	} else if maxFiles := resource.NewQuantity(int64(keepDiagnosticFiles/2*(int(d.Diagnostics.RecorderMaxMB)+1))<<20, resource.BinarySI); ed.SizeLimit == nil || ed.SizeLimit.Cmp(*maxFiles) < 0 {
		t.Errorf("the diagnostics emptyDir's sizeLimit %v is below what the app keeps there (%s): the kubelet would evict the pod", ed.SizeLimit, maxFiles)
	}
	if c.TerminationMessagePath != "/dev/termination-log" || c.TerminationMessagePolicy != corev1.TerminationMessageFallbackToLogsOnError || env["KUMIKO_TERMINATION_LOG"] != "" {
		t.Errorf("termination message at %q (%s), KUMIKO_TERMINATION_LOG %q: want the kubelet's default path, which the app writes by default, and FallbackToLogsOnError",
			c.TerminationMessagePath, c.TerminationMessagePolicy, env["KUMIKO_TERMINATION_LOG"])
	}
	// The mounted config file loads and keeps the budgets the manifest was computed for.
	file := configMap.Data["kumiko.config.yaml"]
	cfg, err := loadConfig(func(k string) string {
		return map[string]string{"KUMIKO_CONFIG": "/etc/kumiko/kumiko.config.yaml", "DATABASE_URL": "postgres://x@db/x", "REDIS_URL": "redis://r"}[k]
	}, nil, func(string) ([]byte, error) { return []byte(file), nil })
	if err != nil {
		t.Fatalf("the ConfigMap's kumiko.config.yaml: %v", err)
	}
	if cfg.Lifecycle.ShutdownTimeout+10*time.Second > grace {
		t.Errorf("the ConfigMap's shutdown budget %s does not fit the grace period %s", cfg.Lifecycle.ShutdownTimeout, grace)
	}
}

// k8s/kustomization.yaml lists every manifest of k8s/ that is a Kubernetes
// object (the Secret is the user's to create), and k8s/dev — the overlay
// scripts/k8s-smoke.sh applies — changes nothing of them but the image tag
// and two settings for the test, and adds only dev dependencies labelled as such.
func TestKubernetesDevOverlay(t *testing.T) {
	type kustomization struct {
		APIVersion string `json:"apiVersion"`
		Kind       string `json:"kind"`
		Resources  []string
		Images     []struct{ Name, NewTag string }
		Patches    []struct {
			Target struct{ Kind, Name string }
			Patch  string
		}
	}
	read := func(file string) kustomization {
		raw, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		var k kustomization
		if err := yaml.UnmarshalStrict(raw, &k); err != nil {
			t.Fatalf("%s: %v", file, err)
		}
		return k
	}
	base := read("k8s/kustomization.yaml")
	files, _ := filepath.Glob("k8s/*.yaml")
	for _, file := range files {
		name := filepath.Base(file)
		switch name {
		case "kustomization.yaml", "prometheus-alerts.yaml", "secret.example.yaml":
			continue
		}
		if !slices.Contains(base.Resources, name) {
			t.Errorf("k8s/kustomization.yaml does not list %s", name)
		}
	}

	dev := read("k8s/dev/kustomization.yaml")
	var devOwn []string
	for _, res := range dev.Resources {
		if name, ok := strings.CutPrefix(res, "../"); ok {
			if !slices.Contains(base.Resources, name) {
				t.Errorf("k8s/dev takes ../%s, which k8s/kustomization.yaml does not list", name)
			}
		} else {
			devOwn = append(devOwn, res)
		}
	}
	for _, name := range base.Resources {
		if !slices.Contains(dev.Resources, "../"+name) {
			t.Errorf("k8s/dev leaves out ../%s: the overlay must apply all of k8s/", name)
		}
	}
	if len(dev.Images) != 1 || dev.Images[0].Name != "kumiko-lifecycle-demo" {
		t.Errorf("k8s/dev may change the app image's tag only, got %+v", dev.Images)
	}
	for _, p := range dev.Patches {
		var ops []struct{ Op, Path string }
		if err := yaml.Unmarshal([]byte(p.Patch), &ops); err != nil {
			t.Fatalf("k8s/dev patch: %v", err)
		}
		for _, op := range ops {
			if p.Target.Kind != "Deployment" || op.Op != "add" || op.Path != "/spec/template/spec/containers/0/env/-" {
				t.Errorf("k8s/dev may only add env vars to the Deployment, got %s %s on %s", op.Op, op.Path, p.Target.Kind)
			}
		}
	}
	for _, res := range devOwn {
		raw, err := os.ReadFile(filepath.Join("k8s/dev", res))
		if err != nil {
			t.Fatal(err)
		}
		for _, doc := range strings.Split(string(raw), "\n---\n") {
			var meta struct {
				Kind     string
				Metadata struct{ Labels map[string]string }
			}
			yaml.Unmarshal([]byte(doc), &meta)
			var obj any
			switch meta.Kind {
			case "Deployment":
				obj = &appsv1.Deployment{}
			case "Service":
				obj = &corev1.Service{}
			case "Secret":
				obj = &corev1.Secret{}
			default:
				t.Errorf("k8s/dev/%s: unexpected kind %q", res, meta.Kind)
				continue
			}
			if err := yaml.UnmarshalStrict([]byte(doc), obj); err != nil {
				t.Errorf("k8s/dev/%s does not decode strictly into %s: %v", res, meta.Kind, err)
			}
			if meta.Metadata.Labels["kumiko.dev/dependency"] != "true" {
				t.Errorf("k8s/dev/%s: a %s without the label kumiko.dev/dependency=true", res, meta.Kind)
			}
		}
	}
}

// (issue 11) HAProxy re-resolves app1/app2 through Docker's DNS, so it starts
// while an app container is stopped and follows a restarted container's new
// IP, and it never cuts a request the demo allows. The Dockerfile has no
// `# syntax=` line, which would make BuildKit contact a registry.
func TestHAProxyFollowsContainersAndDockerfileBuildsOffline(t *testing.T) {
	raw, err := os.ReadFile("deploy/haproxy.cfg")
	if err != nil {
		t.Fatal(err)
	}
	sections := map[string][]string{} // "resolvers docker" -> its lines
	var current string
	for _, line := range strings.Split(string(raw), "\n") {
		if i := strings.Index(line, "#"); i >= 0 {
			line = line[:i]
		}
		if strings.TrimSpace(line) == "" {
			continue
		}
		if line[0] != ' ' && line[0] != '\t' {
			current = strings.Join(strings.Fields(line), " ")
			continue
		}
		sections[current] = append(sections[current], strings.Join(strings.Fields(line), " "))
	}
	if !slices.Contains(sections["resolvers docker"], "nameserver dns 127.0.0.11:53") {
		t.Errorf("no `resolvers docker` section with Docker's DNS 127.0.0.11:53: %q", sections["resolvers docker"])
	}
	var defaultServer string
	servers := 0
	for _, line := range sections["backend apps"] {
		if strings.HasPrefix(line, "default-server ") {
			defaultServer = line
		}
	}
	for _, line := range sections["backend apps"] {
		if !strings.HasPrefix(line, "server ") {
			continue
		}
		servers++
		opts := " " + defaultServer + " " + line + " "
		if !strings.Contains(opts, " resolvers docker ") || !regexpInitAddrNone.MatchString(opts) {
			t.Errorf("%q (with %q) must use `resolvers docker` and `init-addr ...,none`", line, defaultServer)
		}
	}
	if servers != 2 {
		t.Errorf("want 2 servers in backend apps, got %d", servers)
	}
	timeoutServer := time.Duration(0)
	for _, line := range sections["defaults"] {
		if v, ok := strings.CutPrefix(line, "timeout server "); ok {
			timeoutServer, err = time.ParseDuration(v)
			if err != nil {
				t.Fatalf("timeout server %q: %v", v, err)
			}
		}
	}
	if demoSlowMax := defaultConfig().HTTP.SlowMax; timeoutServer <= demoSlowMax {
		t.Errorf("timeout server %s cuts requests the demo allows (/api/slow up to %s): want more, with margin", timeoutServer, demoSlowMax)
	}

	dockerfile, err := os.ReadFile("Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	if regexp.MustCompile(`(?mi)^#\s*syntax\s*=`).Match(dockerfile) {
		t.Errorf("the Dockerfile has a `# syntax=` line: BuildKit would fetch that frontend from a registry")
	}
}

var regexpInitAddrNone = regexp.MustCompile(` init-addr (\S+,)?none[ ,]`)
