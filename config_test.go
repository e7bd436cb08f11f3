package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"
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
	return loadConfig(fakeGetenv(env), environOf(env), fakeReadFile(files))
}

// configProblems splits a loadConfig error into its problems, one per line,
// after the heading line.
func configProblems(err error) []string {
	_, list, _ := strings.Cut(err.Error(), "\n")
	return strings.Split(list, "\n")
}

// The defaults are declared once, in the settings table; loading with no
// file and no environment must give exactly them.
func TestLoadConfigDefaults(t *testing.T) {
	got, err := loadTestConfig(nil, "")
	if err != nil {
		t.Fatalf("loadConfig: %v", err)
	}
	if !regexp.MustCompile(`^web-1-[0-9a-f]{6}$`).MatchString(got.InstanceID) {
		t.Errorf("InstanceID = %q, want web-1- and 6 hex digits", got.InstanceID)
	}
	want := defaultConfig()
	want.InstanceID, want.DatabaseURL, want.Redis.URL = got.InstanceID, "postgres://app@db:5432/app", "redis://redis:6379/0"
	if !reflect.DeepEqual(got, want) {
		t.Errorf("loadConfig() =\n%+v\nwant the table's defaults\n%+v", got, want)
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
		{name: "file overrides default", file: "lifecycle:\n  linger: 7s\n", get: linger, want: 7 * time.Second},
		{
			name: "env overrides file",
			file: "lifecycle:\n  linger: 7s\n",
			env:  map[string]string{"KUMIKO_LINGER": "9"},
			get:  linger, want: 9 * time.Second,
		},
		{name: "null in file keeps default", file: "lifecycle:\n  linger:\n", get: linger, want: 3 * time.Second},
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
			name: "yaml int seconds", file: "lifecycle:\n  startupTimeout: 60\n",
			get: func(c config) any { return c.Lifecycle.StartupTimeout }, want: time.Minute,
		},
		{
			name: "yaml float seconds", file: "lifecycle:\n  readiness:\n    probeTimeout: 0.25\n",
			get: func(c config) any { return c.Lifecycle.Readiness.ProbeTimeout }, want: 250 * time.Millisecond,
		},
		{
			name: "yaml Go duration", file: "lifecycle:\n  readiness:\n    checkInterval: 250ms\n",
			get: func(c config) any { return c.Lifecycle.Readiness.CheckInterval }, want: 250 * time.Millisecond,
		},
		{
			name: "yaml quoted seconds", file: "lifecycle:\n  heartbeat:\n    ttl: \"12\"\n",
			get: func(c config) any { return c.Heartbeat.TTL }, want: 12 * time.Second,
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
			get:  func(c config) any { return c.LeaderElection.Enabled }, want: false,
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
			get: func(c config) any { return c.Redis.URL }, want: "unix:///run/redis.sock",
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
			want: []string{"kumiko.config.yaml: line 4: unknown key lifecycle.lingerSecs (the closest is lifecycle.linger)"},
		},
		{
			// Spelt here in two parts, so TestEnvNamesInTheTree does not take the typo for a name.
			name: "an unknown KUMIKO_ variable names the closest setting",
			env:  map[string]string{"KUMIKO_" + "LINGERR": "1s", "KUMIKO_" + "MIGRATION_MODE": "auto-apply"},
			want: []string{
				"KUMIKO_" + "LINGERR is set, but no setting reads it (the closest is KUMIKO_LINGER); KUMIKO_UNKNOWN_ENV=warn boots anyway",
				"KUMIKO_" + "MIGRATION_MODE is set, but no setting reads it (the closest is KUMIKO_MIGRATIONS_MODE)",
			},
		},
		{
			name: "three mistakes at once",
			file: "lifecycle:\n  lingerSecs: 3\n",
			env:  map[string]string{"KUMIKO_LINGER": "soon", "KUMIKO_MIGRATIONS_MODE": "yolo"},
			want: []string{
				"kumiko.config.yaml: line 2: unknown key lifecycle.lingerSecs (the closest is lifecycle.linger)",
				`KUMIKO_LINGER: time: invalid duration "soon"`,
				`KUMIKO_MIGRATIONS_MODE: "yolo" is not one of exit-on-pending, auto-apply, warn-on-pending`,
			},
		},
		{
			name: "bad values in the file name the line and key",
			file: "log:\n  format: xml\nlifecycle:\n  heartbeat:\n    ttl: -2\n",
			want: []string{
				`kumiko.config.yaml: line 2: log.format: "xml" is not one of text, json`,
				`kumiko.config.yaml: line 5: lifecycle.heartbeat.ttl: "-2" is negative`,
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
			want: []string{"lifecycle.shutdownTimeout (33s) must be longer than drainTimeout + linger (30s + 3s)"},
		},
		{
			// The rescue delay is no setting of its own: it is derived from
			// jobs.timeout (timeouts.go), so it can never be shorter than
			// the timeout, which River refuses, nor strand jobs for an hour,
			// as the former default did. A config that still sets it is told
			// so with the other problems. Spelt in two parts, so
			// TestEnvNamesInTheTree does not take it for a name.
			name: "the former rescue delay is refused with the other problems",
			file: "jobs:\n  rescueAfter: 1h\n",
			env:  map[string]string{"KUMIKO_" + "JOBS_RESCUE_AFTER": "1h", "KUMIKO_JOBS_TIMEOUT": "0"},
			want: []string{
				"kumiko.config.yaml: line 2: unknown key jobs.rescueAfter",
				"KUMIKO_" + "JOBS_RESCUE_AFTER is set, but no setting reads it",
				"KUMIKO_JOBS_TIMEOUT: must be greater than zero",
			},
		},
		{
			name: "timing rules",
			file: "lifecycle:\n  connectRetryBase: 1m\n  leaderElection:\n    lockTtl: 10s\n    renewInterval: 10s\n",
			env:  map[string]string{"KUMIKO_HEARTBEAT_INTERVAL": "10s"},
			want: []string{
				"lifecycle.connectRetryBase (1m0s) must not exceed connectRetryMax (30s)",
				"lifecycle.leaderElection: the renew deadline, lockTtl − renewInterval (10s − 10s), must exceed 1.2 × renewInterval",
				"lifecycle.heartbeat.interval (10s) must be less than ttl (10s)",
			},
		},
		{
			name: "a leader that would step down before its first renewal",
			env:  map[string]string{"KUMIKO_LEADER_LOCK_TTL": "3s", "KUMIKO_LEADER_RENEW_INTERVAL": "2s"},
			want: []string{"lifecycle.leaderElection: the renew deadline, lockTtl − renewInterval (3s − 2s), must exceed 1.2 × renewInterval"},
		},
		{
			name: "event streams that could take every API connection",
			env:  map[string]string{"KUMIKO_API_MAX_CONNS": "5000"},
			want: []string{"http.maxConns (5000) must exceed sse.maxStreams (5000), or the event streams alone can take every API connection"},
		},
		{
			name: "bounds declared in the table",
			file: "outbox:\n  batchSize: 10001\n",
			env:  map[string]string{"KUMIKO_OUTBOX_MAX_ATTEMPTS": "0", "KUMIKO_JOBS_WORKERS": "0", "KUMIKO_SSE_MAX_STREAMS": "0"},
			want: []string{
				`kumiko.config.yaml: line 2: outbox.batchSize: want a whole number from 1 to 10000, got "10001"`,
				`KUMIKO_OUTBOX_MAX_ATTEMPTS: want a whole number, 1 or more, got "0"`,
				`KUMIKO_JOBS_WORKERS: want a whole number, 1 or more, got "0"`,
				`KUMIKO_SSE_MAX_STREAMS: want a whole number, 1 or more, got "0"`,
			},
		},
		{
			name: "reconnect spread",
			file: "sse:\n  reconnectSpread: soon\n",
			env:  map[string]string{"KUMIKO_SSE_RECONNECT_SPREAD": "-1s", "KUMIKO_SSE_RECONNECT_SPREAD_PER_STREAM": "0"},
			want: []string{
				`kumiko.config.yaml: line 2: sse.reconnectSpread: time: invalid duration "soon"`,
				`KUMIKO_SSE_RECONNECT_SPREAD: "-1s" is negative`,
				"KUMIKO_SSE_RECONNECT_SPREAD_PER_STREAM: must be greater than zero",
			},
		},
		{
			name: "a key under its new and its former name",
			file: "lifecycle:\n  linger: 2s\n  lingerSec: 3\n",
			want: []string{"kumiko.config.yaml: line 3: lifecycle.lingerSec is the former name of lifecycle.linger, which line 2 sets too; keep only lifecycle.linger"},
		},
		{
			name: "a bad value under a former name names that name",
			file: "sse:\n  retrySec: soon\n",
			want: []string{`kumiko.config.yaml: line 2: sse.retrySec: time: invalid duration "soon"`},
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
			c, err := loadConfig(getenv, nil, tt.readFile)
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
			groups := c.logGroups()
			fields := map[string]any{}
			for _, g := range groups {
				maps.Copy(fields, g.fields)
			}

			logged := fmt.Sprint(groups)
			for _, secret := range tt.secrets {
				if strings.Contains(logged, secret) {
					t.Errorf("logGroups leaks %q: %s", secret, logged)
				}
			}
			for key, want := range tt.fields {
				if got := fields[key]; got != want {
					t.Errorf("the config log's %s = %v, want %v", key, got, want)
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

// (issue 49) The config is logged whole, as one line per section of the
// file: every setting once, in the line of its section (the settings alone in
// theirs share "general", the first line), none of the lines the wall of
// text the single line was (2,092 characters).
func TestLogGroupsListEverySetting(t *testing.T) {
	c, err := loadTestConfig(nil, "")
	if err != nil {
		t.Fatalf("loadConfig: %v", err)
	}
	groups := c.logGroups()
	if groups[0].name != "general" {
		t.Errorf("the first config line is %q, want general", groups[0].name)
	}
	logged := map[string]string{} // key → the group it was logged in
	for _, g := range groups {
		if len(g.fields) > 16 {
			t.Errorf("the config line of %s has %d settings: split the section", g.name, len(g.fields))
		}
		for key := range g.fields {
			if other, twice := logged[key]; twice {
				t.Errorf("%s logged in %s and in %s", key, other, g.name)
			}
			logged[key] = g.name
		}
	}
	if len(logged) != len(c.settings()) {
		t.Errorf("the config lines hold %d settings, want every setting (%d)", len(logged), len(c.settings()))
	}
	for key, group := range map[string]string{"lifecycle.linger": "lifecycle", "lifecycle.readiness.probeTimeout": "lifecycle.readiness",
		"http.addr": "http", "instanceId": "general", "log.format": "general", "database.url": "database"} {
		if logged[key] != group {
			t.Errorf("%s logged in group %q, want %q", key, logged[key], group)
		}
	}
	for _, g := range groups {
		if g.name == "lifecycle" && g.fields["lifecycle.linger"] != "3s" {
			t.Errorf(`the config log's lifecycle.linger = %v, want "3s"`, g.fields["lifecycle.linger"])
		}
	}
}

// TestSettingsTable guards the table against drifting from the config struct:
// each config field has exactly one setting, no name is used twice, and every
// setting is documented.
func TestSettingsTable(t *testing.T) {
	var c config
	settings := c.settings()

	names := make(map[string]bool) // file keys, former file keys and environment names share no name
	fieldPtrs := make(map[uintptr]bool)
	for _, s := range settings {
		for _, name := range []string{s.key, s.old, s.env} {
			if names[name] {
				t.Errorf("%s: name used twice", name)
			}
			if name != "" {
				names[name] = true
			}
		}
		if s.doc == "" {
			t.Errorf("%s has no doc", s.key)
		}
		fieldPtrs[reflect.ValueOf(s.value).Field(0).Pointer()] = true // every value's first field points into c
	}

	if n := countStructLeaves(reflect.TypeFor[config]()); len(fieldPtrs) != n {
		t.Errorf("settings cover %d distinct config fields, config has %d", len(fieldPtrs), n)
	}
}

// countStructLeaves counts the exported leaf fields, the settings, and those
// of the embedded blockConfig.
func countStructLeaves(t reflect.Type) int {
	if t.Kind() != reflect.Struct {
		return 1
	}
	n := 0
	for f := range t.Fields() {
		if f.IsExported() || f.Anonymous {
			n += countStructLeaves(f.Type)
		}
	}
	return n
}

// Every former file key still sets its setting, and the load reports it so
// phase 1 can warn.
func TestFormerKeysStillWork(t *testing.T) {
	var c config
	for _, s := range c.settings() {
		if s.old == "" {
			continue
		}
		t.Run(s.old, func(t *testing.T) {
			// Every former key is a *Sec duration. Half a second past the
			// default keeps the cross-setting rules satisfied while still
			// telling the setting apart from its default.
			def, err := parseDuration(s.def)
			if err != nil {
				t.Fatalf("%s: default %q: %v", s.key, s.def, err)
			}
			sample := strconv.FormatFloat((def + 500*time.Millisecond).Seconds(), 'f', -1, 64) // bare seconds, as the former keys promised
			got, err := loadTestConfig(nil, nestedYAML(s.old, sample))
			if err != nil {
				t.Fatalf("loadConfig: %v", err)
			}
			want, err := loadTestConfig(nil, nestedYAML(s.key, sample))
			if err != nil {
				t.Fatalf("loadConfig with %s: %v", s.key, err)
			}
			want.deprecated = []deprecatedKey{{file: configFileName, line: strings.Count(s.old, ".") + 1, key: s.old, use: s.key}}
			got.InstanceID, want.InstanceID = "", ""
			if !reflect.DeepEqual(got, want) {
				t.Errorf("%s: %s gives\n%+v\nwant, as %s: %s and one deprecation\n%+v", s.old, sample, got, s.key, sample, want)
			}
		})
	}
}

// nestedYAML writes the dotted key a.b.c as nested YAML mappings.
func nestedYAML(key, value string) string {
	var b strings.Builder
	parts := strings.Split(key, ".")
	for i, part := range parts {
		b.WriteString(strings.Repeat("  ", i) + part + ":")
		if i < len(parts)-1 {
			b.WriteString("\n")
		}
	}
	b.WriteString(" " + value + "\n")
	return b.String()
}

// Phase 1 warns about each former key it read, with where it was and what to
// write instead. The file is the German spec's lifecycle block, whose keys
// SPEC.md promises keep working.
func TestDeprecatedKeyIsLogged(t *testing.T) {
	t.Chdir(t.TempDir())
	const germanSpecBlock = `lifecycle:
  startupTimeoutSec: 121
  shutdownTimeoutSec: 41
  lingerSec: 4
  drainTimeoutSec: 31
  migrations:
    mode: auto-apply
  leaderElection:
    enabled: true
    lockTtlSec: 16
    heartbeatIntervalSec: 6
`
	if err := os.WriteFile(configFileName, []byte(germanSpecBlock), 0o600); err != nil {
		t.Fatal(err)
	}
	logs := &syncBuffer{}
	a := newApp(fakeGetenv(map[string]string{"KUMIKO_LOG_FORMAT": "json"}), nil, logs)
	if err := a.config(t.Context(), nil); err != nil {
		t.Fatalf("loadConfig: %v", err)
	}
	l := a.cfg.Lifecycle
	got := []time.Duration{l.StartupTimeout, l.ShutdownTimeout, l.Linger, l.DrainTimeout, a.cfg.LeaderElection.LockTTL, a.cfg.LeaderElection.RenewInterval}
	want := []time.Duration{121 * time.Second, 41 * time.Second, 4 * time.Second, 31 * time.Second, 16 * time.Second, 6 * time.Second}
	if !slices.Equal(got, want) {
		t.Errorf("startup, shutdown, linger, drain, lock TTL, renew interval = %v, want %v", got, want)
	}
	for _, w := range []struct {
		line     float64
		key, use string
	}{
		{2, "lifecycle.startupTimeoutSec", "lifecycle.startupTimeout"},
		{3, "lifecycle.shutdownTimeoutSec", "lifecycle.shutdownTimeout"},
		{4, "lifecycle.lingerSec", "lifecycle.linger"},
		{5, "lifecycle.drainTimeoutSec", "lifecycle.drainTimeout"},
		{10, "lifecycle.leaderElection.lockTtlSec", "lifecycle.leaderElection.lockTtl"},
		{11, "lifecycle.leaderElection.heartbeatIntervalSec", "lifecycle.leaderElection.renewInterval"},
	} {
		want := map[string]any{"level": "warning", "msg": "deprecated config key", "component": "config",
			"file": configFileName, "line": w.line, "key": w.key, "use": w.use}
		if logs.find(want) == nil {
			t.Errorf("no log line %v in:\n%s", want, logs.String())
		}
	}
}

// update rewrites the files generated from the settings table instead of
// checking them: go test -run 'TestConfigReferenceInDocs|TestExampleConfigFile' -update .
var update = flag.Bool("update", false, "rewrite docs/configuration.md's reference and kumiko.config.example.yaml from the settings table")

// checkGenerated compares the part of file between the begin and end lines
// with want, or rewrites it with -update.
func checkGenerated(t *testing.T, file, begin, end, want string) {
	t.Helper()
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	before, rest, ok1 := strings.Cut(string(data), begin)
	got, after, ok2 := strings.Cut(rest, end)
	if !ok1 || !ok2 {
		t.Fatalf("%s has no %q ... %q block", file, begin, end)
	}
	if got == want {
		return
	}
	if *update {
		if err := os.WriteFile(file, []byte(before+begin+want+end+after), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	gotLines, wantLines := strings.Split(got, "\n"), strings.Split(want, "\n")
	for i := range max(len(gotLines), len(wantLines)) {
		g, w := "", ""
		if i < len(gotLines) {
			g = gotLines[i]
		}
		if i < len(wantLines) {
			w = wantLines[i]
		}
		if g != w {
			t.Fatalf("%s differs from the settings table at line %d of its generated block:\n got %q\nwant %q\n"+
				"run: go test -run 'TestConfigReferenceInDocs|TestExampleConfigFile' -update .", file, i+1, g, w)
		}
	}
}

// The configuration reference in docs/ is the settings table, rendered: one
// row per setting, then the former file keys in a table of their own.
func TestConfigReferenceInDocs(t *testing.T) {
	checkGenerated(t, "docs/configuration.md", "<!-- config reference: generated from settings() in config.go -->\n",
		"<!-- end of config reference -->", configReference())
}

// `settings` prints the reference an operator would otherwise look up in
// docs/configuration.md, every setting in it.
func TestSettingsCommandPrintsEverySetting(t *testing.T) {
	var out strings.Builder
	if err := run(context.Background(), []string{serviceName, "settings"}, func(string) string { return "" }, nil, &out, io.Discard); err != nil {
		t.Fatalf("settings: %v", err)
	}
	var c config
	for _, s := range c.settings() {
		if !strings.Contains(out.String(), "| `"+s.env+"` | `"+s.key+"` |") {
			t.Errorf("settings does not print %s (%s):\n%s", s.env, s.key, out.String())
		}
	}
}

// The example file is the settings table, rendered: every key, its default,
// its environment name and its doc. It must load and change nothing.
func TestExampleConfigFile(t *testing.T) {
	const file = "kumiko.config.example.yaml"
	checkGenerated(t, file, "# --- generated from settings() in config.go ---\n", "# --- end ---\n", exampleConfig())

	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	_, values, problems := readConfigFile(func(string) string { return "" }, func(string) ([]byte, error) { return data, nil })
	if len(problems) > 0 {
		t.Fatalf("example file: %v", problems)
	}
	// Each section once: a block's settings join the core's section they name.
	var plain map[string]any
	if err := yaml.Unmarshal(data, &plain); err != nil {
		t.Errorf("the example file is not plain YAML: %v", err)
	}
	var c config
	for _, s := range c.settings() {
		if _, ok := values[s.key]; !ok {
			t.Errorf("the example file lacks %s", s.key)
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

func exampleConfig() string {
	var b strings.Builder
	var c config
	var open []string // the sections the previous key was in
	for _, s := range c.settings() {
		parts := strings.Split(s.key, ".")
		sections, leaf := parts[:len(parts)-1], parts[len(parts)-1]
		same := 0
		for same < len(open) && same < len(sections) && open[same] == sections[same] {
			same++
		}
		if same == 0 && len(sections) > 0 && b.Len() > 0 {
			b.WriteString("\n")
		}
		for i := same; i < len(sections); i++ {
			fmt.Fprintf(&b, "%s%s:\n", strings.Repeat("  ", i), sections[i])
		}
		open = sections
		value := s.def
		if !regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._/-]*$`).MatchString(value) {
			value = strconv.Quote(value) // "", ":8080", "@hourly", "*/5 * * * *"
		}
		comment := s.env
		if s.required {
			comment += " (required)"
		}
		fmt.Fprintf(&b, "%-28s # %s — %s\n", strings.Repeat("  ", len(sections))+leaf+": "+value, comment, s.doc)
	}
	return b.String()
}

// environOf is env as os.Environ lines, for loadConfig's environ.
func environOf(env map[string]string) []string {
	var environ []string
	for k, v := range env {
		environ = append(environ, k+"="+v)
	}
	return environ
}

// An unknown KUMIKO_ variable stops the boot (TestLoadConfigProblems) unless
// it is empty, read by the project's own tooling, or the operator chose
// KUMIKO_UNKNOWN_ENV=warn; then phase 1 logs it. Other variables are not the
// service's business.
func TestUnknownEnvironmentVariables(t *testing.T) {
	typo := "KUMIKO_" + "LINGERR" // in two parts: TestEnvNamesInTheTree
	for _, env := range []map[string]string{
		{typo: ""},
		{"KUMIKO_REQUIRE_SERVICES": "1", "KUMIKO_FUZZTIME": "10x"},
		{"LINGER": "1s", "PATH": "/bin", "KUMIKOLINGER": "1s"},
		{"KUMIKO_CONFIG": "", "KUMIKO_LINGER": "1s"},
	} {
		if _, err := loadTestConfig(env, ""); err != nil {
			t.Errorf("%v: %v", env, err)
		}
	}
	c, err := loadTestConfig(map[string]string{typo: "1s", "KUMIKO_UNKNOWN_ENV": "warn"}, "")
	if err != nil || len(c.unknownEnv) != 1 || c.unknownEnv[0] != (unknownVar{name: typo, closest: "KUMIKO_LINGER"}) {
		t.Fatalf("KUMIKO_UNKNOWN_ENV=warn: %+v %v, want the typo kept for phase 1's warning", c.unknownEnv, err)
	}
	if _, err := loadTestConfig(map[string]string{typo: "1s"}, "config:\n  unknownEnv: warn\n"); err != nil {
		t.Errorf("config.unknownEnv: warn in the file: %v", err)
	}

	logs := &syncBuffer{}
	a := newApp(fakeGetenv(map[string]string{typo: "1s", "KUMIKO_UNKNOWN_ENV": "warn", "KUMIKO_LOG_FORMAT": "json"}),
		[]string{typo + "=1s", "KUMIKO_UNKNOWN_ENV=warn"}, logs)
	if err := a.config(context.Background(), &phaseRun{}); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(logs.String(), `"closest":"KUMIKO_LINGER"`) || !strings.Contains(logs.String(), `"name":"`+typo+`"`) {
		t.Errorf("phase 1 did not warn about %s:\n%s", typo, logs.String())
	}
}

// Every KUMIKO_ name in the tree is a setting, KUMIKO_CONFIG or a variable of
// the tooling (toolingEnv): a name the service does not know would stop it
// from booting wherever a script or a manifest sets it.
func TestEnvNamesInTheTree(t *testing.T) {
	known := map[string]bool{"KUMIKO_CONFIG": true}
	c := defaultConfig()
	for _, s := range c.settings() {
		known[s.env] = true
	}
	for _, n := range toolingEnv() {
		known[n] = true
	}
	name := regexp.MustCompile(envPrefix + `[A-Z0-9_]*[A-Z0-9]`)
	err := filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (strings.HasPrefix(d.Name(), ".") && path != "." && d.Name() != ".ci" || d.Name() == "testdata") {
			return filepath.SkipDir
		}
		if d.IsDir() || !(slices.Contains([]string{".go", ".sh", ".md", ".yml", ".yaml", ".cfg", ".html"}, filepath.Ext(path)) || d.Name() == "Dockerfile" || d.Name() == "run") {
			return nil
		}
		raw, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for _, n := range name.FindAllString(string(raw), -1) {
			if !known[n] {
				t.Errorf("%s names %s, which is neither a setting nor in toolingEnv", path, n)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
