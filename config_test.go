package main

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"
)

// fakeGetenv serves env on top of the smallest environment that loads: the
// two required URLs, and a fixed host name so the instance ID is predictable.
// An empty value in env unsets a variable.
func fakeGetenv(env map[string]string) func(string) string {
	base := map[string]string{
		"HOSTNAME":     "web-1",
		"DATABASE_URL": "postgres://app@db:5432/app",
		"REDIS_URL":    "redis://redis:6379/0",
	}
	return func(key string) string {
		if v, ok := env[key]; ok {
			return v
		}
		return base[key]
	}
}

// fakeReadFile serves files by name; no other file exists.
func fakeReadFile(files map[string]string) func(string) ([]byte, error) {
	return func(name string) ([]byte, error) {
		if data, ok := files[name]; ok {
			return []byte(data), nil
		}
		return nil, &fs.PathError{Op: "open", Path: name, Err: fs.ErrNotExist}
	}
}

// loadTestConfig loads from fakeGetenv(env) and, unless yaml is empty, a
// kumiko.config.yaml holding yaml.
func loadTestConfig(env map[string]string, yaml string) (config, error) {
	files := make(map[string]string)
	if yaml != "" {
		files[configFileName] = yaml
	}
	return loadConfig(fakeGetenv(env), fakeReadFile(files))
}

// configProblems splits a loadConfig error into its problems, one per line,
// after the heading line.
func configProblems(err error) []string {
	_, list, _ := strings.Cut(err.Error(), "\n")
	return strings.Split(list, "\n")
}

func TestLoadConfigDefaults(t *testing.T) {
	got, err := loadTestConfig(nil, "")
	if err != nil {
		t.Fatalf("loadConfig: %v", err)
	}
	if !regexp.MustCompile(`^web-1-[0-9a-f]{6}$`).MatchString(got.InstanceID) {
		t.Errorf("InstanceID = %q, want web-1- and 6 hex digits", got.InstanceID)
	}
	got.InstanceID = ""

	want := config{
		HTTPAddr:    ":8080",
		OpsAddr:     ":9090",
		LogFormat:   "text",
		DatabaseURL: "postgres://app@db:5432/app",
		RedisURL:    "redis://redis:6379/0",
		Storage:     storageConfig{Bucket: "kumiko-demo"},
		Outbox: outboxConfig{BatchSize: 100, PollInterval: time.Second, Listen: true, MaxAttempts: 10,
			RetryBase: time.Second, RetryMax: 5 * time.Minute,
			Retention: 7 * 24 * time.Hour, PurgeCron: "@hourly"},
		SSE: sseConfig{MaxStreams: 5000, Heartbeat: 15 * time.Second, RetryHint: time.Second,
			WriteTimeout: 10 * time.Second, MaxStreamsPerIP: 20},
		Jobs: jobsConfig{Workers: 10, PollInterval: time.Second, Timeout: time.Minute, RescueAfter: time.Hour,
			ReportCron: "*/5 * * * *"},
		HTTP: httpConfig{ReadHeaderTimeout: 5 * time.Second, ReadTimeout: 15 * time.Second, IdleTimeout: time.Minute,
			RateLimit: 500, RateBurst: 1000, SlowMax: time.Minute, DemoEndpoints: true},
		Lifecycle: lifecycleConfig{
			StartupTimeout:   120 * time.Second,
			ShutdownTimeout:  40 * time.Second,
			Linger:           3 * time.Second,
			DrainTimeout:     30 * time.Second,
			PhaseTimeout:     30 * time.Second,
			ConnectMaxWait:   5 * time.Minute,
			ConnectRetryBase: 1 * time.Second,
			ConnectRetryMax:  30 * time.Second,
			Migrations:       migrationsConfig{Mode: "exit-on-pending"},
			LeaderElection:   leaderElectionConfig{Enabled: true, LockTTL: 15 * time.Second, RenewInterval: 5 * time.Second},
			Heartbeat:        heartbeatConfig{Interval: 5 * time.Second, TTL: 10 * time.Second},
			Readiness:        readinessConfig{ProbeTimeout: 1 * time.Second, CacheTTL: 1 * time.Second},
		},
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("loadConfig() =\n%+v\nwant\n%+v", got, want)
	}
}

func TestLoadConfigSources(t *testing.T) {
	linger := func(c config) any { return c.Lifecycle.Linger }

	tests := []struct {
		name string
		file string
		env  map[string]string
		get  func(config) any
		want any
	}{
		{name: "file overrides default", file: "lifecycle:\n  lingerSec: 7\n", get: linger, want: 7 * time.Second},
		{
			name: "env overrides file",
			file: "lifecycle:\n  lingerSec: 7\n",
			env:  map[string]string{"KUMIKO_LINGER": "9"},
			get:  linger, want: 9 * time.Second,
		},
		{name: "null in file keeps default", file: "lifecycle:\n  lingerSec:\n", get: linger, want: 3 * time.Second},
		{name: "comment-only file", file: "# nothing yet\n", get: linger, want: 3 * time.Second},
		{name: "zero linger", env: map[string]string{"KUMIKO_LINGER": "0"}, get: linger, want: time.Duration(0)},

		// Durations: bare numbers are seconds, everywhere.
		{
			name: "env bare seconds", env: map[string]string{"KUMIKO_DRAIN_TIMEOUT": "0.5"},
			get: func(c config) any { return c.Lifecycle.DrainTimeout }, want: 500 * time.Millisecond,
		},
		{
			name: "env Go duration", env: map[string]string{"KUMIKO_CONNECT_MAX_WAIT": "1m30s"},
			get: func(c config) any { return c.Lifecycle.ConnectMaxWait }, want: 90 * time.Second,
		},
		{
			name: "yaml int seconds", file: "lifecycle:\n  startupTimeoutSec: 60\n",
			get: func(c config) any { return c.Lifecycle.StartupTimeout }, want: time.Minute,
		},
		{
			name: "yaml float seconds", file: "lifecycle:\n  readiness:\n    probeTimeoutSec: 0.25\n",
			get: func(c config) any { return c.Lifecycle.Readiness.ProbeTimeout }, want: 250 * time.Millisecond,
		},
		{
			name: "yaml Go duration", file: "lifecycle:\n  readiness:\n    cacheTtlSec: 250ms\n",
			get: func(c config) any { return c.Lifecycle.Readiness.CacheTTL }, want: 250 * time.Millisecond,
		},
		{
			name: "yaml quoted seconds", file: "lifecycle:\n  heartbeat:\n    ttlSec: \"12\"\n",
			get: func(c config) any { return c.Lifecycle.Heartbeat.TTL }, want: 12 * time.Second,
		},

		// Other kinds, from both sources.
		{
			name: "yaml nested keys",
			file: "lifecycle:\n  migrations:\n    mode: auto-apply\n    schemaBaseline: 42\n",
			get:  func(c config) any { return c.Lifecycle.Migrations }, want: migrationsConfig{Mode: "auto-apply", SchemaBaseline: 42},
		},
		{
			name: "yaml bool", file: "storage:\n  useSSL: true\n",
			get: func(c config) any { return c.Storage.UseSSL }, want: true,
		},
		{
			name: "env bool as 1", env: map[string]string{"S3_USE_SSL": "1"},
			get: func(c config) any { return c.Storage.UseSSL }, want: true,
		},
		{
			name: "disabled leader election skips the lock checks",
			env:  map[string]string{"KUMIKO_LEADER_ENABLED": "false", "KUMIKO_LEADER_RENEW_INTERVAL": "60"},
			get:  func(c config) any { return c.Lifecycle.LeaderElection.Enabled }, want: false,
		},
		{
			name: "both listeners on port 0", env: map[string]string{"KUMIKO_HTTP_ADDR": ":0", "KUMIKO_OPS_ADDR": "127.0.0.1:0"},
			get: func(c config) any { return c.HTTPAddr + " " + c.OpsAddr }, want: ":0 127.0.0.1:0",
		},
		{
			name: "instance ID from env", env: map[string]string{"KUMIKO_INSTANCE_ID": "blue-7"},
			get: func(c config) any { return c.InstanceID }, want: "blue-7",
		},
		{
			name: "redis over a unix socket", file: "redis:\n  url: unix:///run/redis.sock\n",
			env: map[string]string{"REDIS_URL": ""},
			get: func(c config) any { return c.RedisURL }, want: "unix:///run/redis.sock",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := loadTestConfig(tt.env, tt.file)
			if err != nil {
				t.Fatalf("loadConfig: %v", err)
			}
			if got := tt.get(c); got != tt.want {
				t.Errorf("got %v, want %v", got, tt.want)
			}
		})
	}
}

func TestLoadConfigProblems(t *testing.T) {
	tests := []struct {
		name    string
		file    string
		env     map[string]string
		want    []string // one substring per expected problem
		notWant []string // must appear nowhere, e.g. secrets
	}{
		{
			name: "unknown key names the key and line",
			file: "http:\n  addr: \":8081\"\nlifecycle:\n  lingerSecs: 3\n",
			want: []string{"kumiko.config.yaml: line 4: unknown key lifecycle.lingerSecs"},
		},
		{
			name: "three mistakes at once",
			file: "lifecycle:\n  lingerSecs: 3\n",
			env:  map[string]string{"KUMIKO_LINGER": "soon", "KUMIKO_MIGRATIONS_MODE": "yolo"},
			want: []string{
				"kumiko.config.yaml: line 2: unknown key lifecycle.lingerSecs",
				`KUMIKO_LINGER: time: invalid duration "soon"`,
				`KUMIKO_MIGRATIONS_MODE: "yolo" is not one of exit-on-pending, auto-apply, warn-on-pending`,
			},
		},
		{
			name: "bad values in the file name the line and key",
			file: "log:\n  format: xml\nlifecycle:\n  heartbeat:\n    ttlSec: -2\n",
			want: []string{
				`kumiko.config.yaml: line 2: log.format: "xml" is not one of text, json`,
				`kumiko.config.yaml: line 5: lifecycle.heartbeat.ttlSec: "-2" is negative`,
			},
		},
		{
			name: "bad value in both file and env",
			file: "storage:\n  useSSL: maybe\n",
			env:  map[string]string{"S3_USE_SSL": "yes"},
			want: []string{
				`kumiko.config.yaml: line 2: storage.useSSL: want true, false, 1 or 0, got "maybe"`,
				`S3_USE_SSL: want true, false, 1 or 0, got "yes"`,
			},
		},
		{
			name: "list where a value belongs",
			file: "log:\n  format: [json]\n",
			want: []string{"kumiko.config.yaml: line 2: log.format: expected a single value"},
		},
		{
			name: "value where a section belongs",
			file: "lifecycle: 5\n",
			want: []string{"kumiko.config.yaml: line 1: lifecycle expected a mapping of keys"},
		},
		{
			name: "malformed yaml",
			file: "http: [\n",
			want: []string{"kumiko.config.yaml: yaml: line"},
		},
		{
			name: "two documents",
			file: "log:\n  format: json\n---\nlog:\n  format: text\n",
			want: []string{"kumiko.config.yaml: only one YAML document is allowed"},
		},
		{
			name: "missing required URLs",
			env:  map[string]string{"DATABASE_URL": "", "REDIS_URL": ""},
			want: []string{"DATABASE_URL is required", "REDIS_URL is required"},
		},
		{
			name: "wrong URL schemes, without leaking passwords",
			env: map[string]string{
				"DATABASE_URL": "mysql://app:hunter2@db/app",
				"REDIS_URL":    "localhost:6379",
				"MEILI_URL":    "ftp://meili",
			},
			want: []string{
				`DATABASE_URL: the URL scheme must be one of postgres, postgresql, got "mysql"`,
				`REDIS_URL: the URL scheme must be one of redis, rediss, unix, got "localhost"`,
				`MEILI_URL: the URL scheme must be one of http, https, got "ftp"`,
			},
			notWant: []string{"hunter2", "DATABASE_URL is required"},
		},
		{
			name:    "unparsable URL, without leaking its password",
			env:     map[string]string{"DATABASE_URL": "postgres://app:hunter2@db:port/app"},
			want:    []string{`DATABASE_URL: not a valid URL: invalid port ":port" after host`},
			notWant: []string{"hunter2"},
		},
		{
			name:    "short admin token, without leaking it",
			env:     map[string]string{"KUMIKO_ADMIN_TOKEN": "hunter2"},
			want:    []string{"KUMIKO_ADMIN_TOKEN: must be at least 16 characters long, got 7"},
			notWant: []string{"hunter2"},
		},
		{
			name: "bad addresses",
			env:  map[string]string{"KUMIKO_HTTP_ADDR": "8080", "KUMIKO_OPS_ADDR": "localhost:http", "S3_ENDPOINT": "http://minio:9000"},
			want: []string{
				"KUMIKO_HTTP_ADDR: want host:port",
				`KUMIKO_OPS_ADDR: port "http" is not a number`,
				"S3_ENDPOINT: want host:port",
				"storage.accessKey and storage.secretKey",
			},
		},
		{
			name: "listeners on one port",
			env:  map[string]string{"KUMIKO_HTTP_ADDR": "0.0.0.0:9090"},
			want: []string{"http.addr (0.0.0.0:9090) and ops.addr (:9090) must use different ports"},
		},
		{
			name: "storage endpoint without keys",
			env:  map[string]string{"S3_ENDPOINT": "minio:9000", "S3_ACCESS_KEY": "kumiko"},
			want: []string{"storage.accessKey and storage.secretKey (S3_ACCESS_KEY, S3_SECRET_KEY) are required when storage.endpoint is set"},
		},
		{
			name: "master key twice",
			env:  map[string]string{"KUMIKO_MASTER_KEY": "k", "KUMIKO_MASTER_KEY_FILE": "/run/secrets/master"},
			want: []string{"secrets.masterKey and secrets.masterKeyFile (KUMIKO_MASTER_KEY, KUMIKO_MASTER_KEY_FILE) are both set"},
		},
		{
			name: "zero and negative durations",
			env: map[string]string{
				"KUMIKO_PHASE_TIMEOUT":    "0",
				"KUMIKO_CONNECT_MAX_WAIT": "0s",
				"KUMIKO_LINGER":           "-1s",
				"KUMIKO_SCHEMA_BASELINE":  "-1",
			},
			want: []string{
				"KUMIKO_PHASE_TIMEOUT: must be greater than zero",
				"KUMIKO_CONNECT_MAX_WAIT: must be greater than zero",
				`KUMIKO_LINGER: "-1s" is negative`,
				`KUMIKO_SCHEMA_BASELINE: want a whole number, 0 or more, got "-1"`,
			},
		},
		{
			name: "drain and linger leave no time to shut down",
			env:  map[string]string{"KUMIKO_SHUTDOWN_TIMEOUT": "33"}, // 30s drain + 3s linger
			want: []string{"lifecycle.shutdownTimeoutSec (33s) must be longer than drainTimeoutSec + lingerSec (30s + 3s)"},
		},
		{
			name: "timing rules",
			file: "lifecycle:\n  connectRetryBaseSec: 1m\n  leaderElection:\n    lockTtlSec: 10\n    heartbeatIntervalSec: 10\n",
			env:  map[string]string{"KUMIKO_HEARTBEAT_INTERVAL": "10s"},
			want: []string{
				"lifecycle.connectRetryBaseSec (1m0s) must not exceed connectRetryMaxSec (30s)",
				"lifecycle.leaderElection.heartbeatIntervalSec (10s) must be less than lockTtlSec (10s)",
				"lifecycle.heartbeat.intervalSec (10s) must be less than ttlSec (10s)",
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := loadTestConfig(tt.env, tt.file)
			if err == nil {
				t.Fatalf("loadConfig succeeded, want %d problems", len(tt.want))
			}
			got := configProblems(err)
			if len(got) != len(tt.want) {
				t.Errorf("got %d problems, want %d:\n%v", len(got), len(tt.want), err)
			}
			for _, want := range tt.want {
				if !slices.ContainsFunc(got, func(line string) bool { return strings.Contains(line, want) }) {
					t.Errorf("no problem mentions %q in:\n%v", want, err)
				}
			}
			for _, notWant := range tt.notWant {
				if strings.Contains(err.Error(), notWant) {
					t.Errorf("error contains %q:\n%v", notWant, err)
				}
			}
		})
	}
}

func TestLoadConfigFileLocation(t *testing.T) {
	notFound := fakeReadFile(nil)
	only := func(name, yaml string) func(string) ([]byte, error) {
		return fakeReadFile(map[string]string{name: yaml})
	}
	tests := []struct {
		name       string
		configEnv  string // KUMIKO_CONFIG
		readFile   func(string) ([]byte, error)
		wantFormat string
		wantErr    error
	}{
		{name: "no file is fine", readFile: notFound, wantFormat: "text"},
		{name: "file in the working directory", readFile: only(configFileName, "log:\n  format: json\n"), wantFormat: "json"},
		{
			name:      "KUMIKO_CONFIG names the file",
			configEnv: "/etc/kumiko/prod.yaml", readFile: only("/etc/kumiko/prod.yaml", "log:\n  format: json\n"), wantFormat: "json",
		},
		{
			name:      "KUMIKO_CONFIG naming a missing file",
			configEnv: "/etc/kumiko/prod.yaml", readFile: only(configFileName, "log:\n  format: json\n"), wantErr: fs.ErrNotExist,
		},
		{
			name: "unreadable file in the working directory",
			readFile: func(name string) ([]byte, error) {
				return nil, &fs.PathError{Op: "open", Path: name, Err: fs.ErrPermission}
			},
			wantErr: fs.ErrPermission,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			getenv := fakeGetenv(map[string]string{"KUMIKO_CONFIG": tt.configEnv})
			c, err := loadConfig(getenv, tt.readFile)
			if tt.wantErr != nil {
				if !errors.Is(err, tt.wantErr) {
					t.Fatalf("loadConfig error = %v, want %v", err, tt.wantErr)
				}
				if tt.configEnv != "" && !strings.Contains(err.Error(), "KUMIKO_CONFIG: ") {
					t.Errorf("error does not name KUMIKO_CONFIG: %v", err)
				}
				return
			}
			if err != nil {
				t.Fatalf("loadConfig: %v", err)
			}
			if c.LogFormat != tt.wantFormat {
				t.Errorf("LogFormat = %q, want %q", c.LogFormat, tt.wantFormat)
			}
		})
	}
}

func TestSecretsAreMasked(t *testing.T) {
	tests := []struct {
		name    string
		env     map[string]string
		secrets []string
		fields  map[string]any // spot checks of logFields
	}{
		{
			name: "nothing secret set",
			fields: map[string]any{
				"database.url": "postgres://app@db:5432/app",
				"admin.token":  "",
				"search.url":   "",
			},
		},
		{
			name: "every secret set",
			env: map[string]string{
				"DATABASE_URL":       "postgres://app:db-pass-1@db:5432/app?sslmode=disable",
				"REDIS_URL":          "redis://:redis-pass-2@redis:6379/0",
				"KUMIKO_ADMIN_TOKEN": "admin-token-3-0123456789",
				"MEILI_URL":          "https://search:meili-pass-4@meili:7700",
				"MEILI_API_KEY":      "meili-key-5",
				"S3_ENDPOINT":        "minio:9000",
				"S3_ACCESS_KEY":      "s3-access-6",
				"S3_SECRET_KEY":      "s3-secret-7",
				"KUMIKO_MASTER_KEY":  "master-key-8",
			},
			secrets: []string{
				"db-pass-1", "redis-pass-2", "admin-token-3-0123456789", "meili-pass-4",
				"meili-key-5", "s3-access-6", "s3-secret-7", "master-key-8",
			},
			fields: map[string]any{
				"database.url":          "postgres://app:xxxxx@db:5432/app?sslmode=disable",
				"redis.url":             "redis://:xxxxx@redis:6379/0",
				"admin.token":           "[redacted]",
				"storage.secretKey":     "[redacted]",
				"storage.endpoint":      "minio:9000",
				"secrets.masterKeyFile": "",
			},
		},
		{
			name:    "password as a query parameter",
			env:     map[string]string{"DATABASE_URL": "postgresql:///app?host=/run/pg&password=db-pass-9"},
			secrets: []string{"db-pass-9"},
			fields:  map[string]any{"database.url": "postgresql:///app?host=%2Frun%2Fpg&password=xxxxx"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := loadTestConfig(tt.env, "")
			if err != nil {
				t.Fatalf("loadConfig: %v", err)
			}
			fields := c.logFields()

			logged := fmt.Sprint(fields)
			for _, secret := range tt.secrets {
				if strings.Contains(logged, secret) {
					t.Errorf("logFields leaks %q: %s", secret, logged)
				}
			}
			for key, want := range tt.fields {
				if got := fields[key]; got != want {
					t.Errorf("logFields()[%q] = %v, want %v", key, got, want)
				}
			}
			if got := c.secrets(); !sameStrings(got, tt.secrets) {
				t.Errorf("secrets() = %q, want %q", got, tt.secrets)
			}
		})
	}
}

// sameStrings reports whether a and b hold the same strings in any order.
func sameStrings(a, b []string) bool {
	a, b = slices.Sorted(slices.Values(a)), slices.Sorted(slices.Values(b))
	return slices.Equal(a, b)
}

func TestLogFieldsListsEverySetting(t *testing.T) {
	c, err := loadTestConfig(nil, "")
	if err != nil {
		t.Fatalf("loadConfig: %v", err)
	}
	fields := c.logFields()
	if len(fields) != len(c.settings()) {
		t.Errorf("logFields has %d fields, want one per setting (%d)", len(fields), len(c.settings()))
	}
	if got := fields["lifecycle.lingerSec"]; got != "3s" {
		t.Errorf(`logFields()["lifecycle.lingerSec"] = %v, want "3s"`, got)
	}
}

// TestSettingsTable guards the table against drifting from the config struct:
// each config field has exactly one setting, and no name is used twice.
func TestSettingsTable(t *testing.T) {
	var c config
	settings := c.settings()

	yamlPaths := make(map[string]bool)
	envNames := make(map[string]bool)
	fieldPtrs := make(map[uintptr]bool)
	for _, s := range settings {
		if yamlPaths[s.yaml] || envNames[s.env] {
			t.Errorf("%s / %s: name used twice", s.yaml, s.env)
		}
		yamlPaths[s.yaml], envNames[s.env] = true, true
		fieldPtrs[reflect.ValueOf(s.value).Field(0).Pointer()] = true // every value's first field points into c
	}

	if n := countStructLeaves(reflect.TypeFor[config]()); len(fieldPtrs) != n {
		t.Errorf("settings cover %d distinct config fields, config has %d", len(fieldPtrs), n)
	}

}

func countStructLeaves(t reflect.Type) int {
	if t.Kind() != reflect.Struct {
		return 1
	}
	n := 0
	for f := range t.Fields() {
		n += countStructLeaves(f.Type)
	}
	return n
}

func TestParseDuration(t *testing.T) {
	tests := []struct {
		in      string
		want    time.Duration
		wantErr bool
	}{
		{in: "250ms", want: 250 * time.Millisecond},
		{in: "3s", want: 3 * time.Second},
		{in: "1m30s", want: 90 * time.Second},
		{in: "3", want: 3 * time.Second},
		{in: "0.5", want: 500 * time.Millisecond},
		{in: "0.1", want: 100 * time.Millisecond},
		{in: "0", want: 0},
		{in: "-2", want: -2 * time.Second}, // callers decide whether negative is allowed
		{in: "", wantErr: true},
		{in: "soon", wantErr: true},
		{in: "3 s", wantErr: true},
		{in: "NaN", wantErr: true},
		{in: "Inf", wantErr: true},
		{in: "1e10", wantErr: true}, // 317 years
	}
	for _, tt := range tests {
		got, err := parseDuration(tt.in)
		if (err != nil) != tt.wantErr || got != tt.want {
			t.Errorf("parseDuration(%q) = %v, %v; want %v, error %t", tt.in, got, err, tt.want, tt.wantErr)
		}
	}
}

// The example file documents every setting with its default: it must load,
// name every key of the table, and change nothing.
func TestExampleConfigFileIsCompleteAndDefault(t *testing.T) {
	data, err := os.ReadFile("kumiko.config.example.yaml")
	if err != nil {
		t.Fatal(err)
	}
	_, values, problems := readConfigFile(func(string) string { return "" }, func(string) ([]byte, error) { return data, nil })
	if len(problems) > 0 {
		t.Fatalf("example file: %v", problems)
	}
	var c config
	for _, s := range c.settings() {
		if _, ok := values[s.yaml]; !ok {
			t.Errorf("the example file lacks %s", s.yaml)
		}
	}
	got, err := loadTestConfig(map[string]string{"KUMIKO_INSTANCE_ID": "x"}, string(data))
	if err != nil {
		t.Fatal(err)
	}
	want, _ := loadTestConfig(map[string]string{"KUMIKO_INSTANCE_ID": "x"}, "")
	if !reflect.DeepEqual(got, want) {
		t.Errorf("the example file changes the defaults:\n got %+v\nwant %+v", got, want)
	}
}
