package main

import (
	"context"
	"fmt"
	"net/http"
	"slices"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"
)

// componentStorage is the S3 client.
var componentStorage = component{name: "storage"}

// storageConfig is the storage block's settings.
type storageConfig struct {
	Endpoint  string
	AccessKey string
	SecretKey string
	Bucket    string
	UseSSL    bool
}

func (c *storageConfig) settings() []configSetting {
	return []configSetting{
		{key: "storage.endpoint", env: "S3_ENDPOINT", value: addrValue{p: &c.Endpoint, optional: true},
			doc: "S3 server; empty skips phase 12"},
		{key: "storage.accessKey", env: "S3_ACCESS_KEY", value: secretValue{p: &c.AccessKey},
			doc: "S3 access key, required with an endpoint"},
		{key: "storage.secretKey", env: "S3_SECRET_KEY", value: secretValue{p: &c.SecretKey},
			doc: "S3 secret key, required with an endpoint"},
		{key: "storage.bucket", env: "S3_BUCKET", def: "kumiko-demo", value: textValue{p: &c.Bucket},
			doc: "the bucket the features write their files to, created at boot when missing"},
		{key: "storage.useSSL", env: "S3_USE_SSL", def: "false", value: boolValue{p: &c.UseSSL},
			doc: "talk TLS to the S3 server"},
	}
}

func (c *storageConfig) validate() []error {
	return slices.Concat(
		rule(c.Endpoint == "" || (c.AccessKey != "" && c.SecretKey != ""),
			"storage.accessKey and storage.secretKey (S3_ACCESS_KEY, S3_SECRET_KEY) are required when storage.endpoint is set"),
		rule(c.Endpoint == "" || c.Bucket != "", "storage.bucket must not be empty when storage.endpoint is set"))
}

// fileStorage is phase 12: the S3-compatible bucket, created when missing.
// Like search it is optional: when it is down the boot goes on and the features
// that write objects degrade; its readiness check never fails readiness.
// storageConns bounds the connections to the object store: the jobs write
// objects in parallel, and past what the server works at once more
// connections only queue inside it.
const storageConns = 32

func (a *app) fileStorage(ctx context.Context, p *phaseRun) error {
	s := a.cfg.Storage
	if !anyUses(a.features, usesStorage) {
		a.health.RegisterSkipped(componentStorage.String(), "no feature uses file storage")
		return skipPhase("no feature uses file storage")
	}
	if s.Endpoint == "" {
		a.health.RegisterSkipped(componentStorage.String(), "S3_ENDPOINT is not set")
		return skipPhase("S3_ENDPOINT is not set")
	}
	// A transport of its own, so the drain can close its idle connections
	// (minio's default one is shared and never closed). The jobs write many
	// objects at once: net/http's default keeps 2 idle connections per host,
	// so the others would be opened and closed for every object (a TCP
	// handshake and a TIME_WAIT each); storageConns bounds and keeps them.
	transport := http.DefaultTransport.(*http.Transport).Clone()
	transport.MaxConnsPerHost, transport.MaxIdleConnsPerHost = storageConns, storageConns
	client, err := minio.New(s.Endpoint, &minio.Options{
		Creds:     credentials.NewStaticV4(s.AccessKey, s.SecretKey, ""),
		Secure:    s.UseSSL,
		Transport: transport,
	})
	if err != nil {
		return fmt.Errorf("creating the S3 client for %s: %w", s.Endpoint, err)
	}
	a.storage = client
	a.lc.RegisterShutdownHook(componentStorage, func(context.Context) error { transport.CloseIdleConnections(); return nil })
	a.health.RegisterReadinessCheck(componentStorage.String(), false, func(ctx context.Context) checkResult {
		return timedCheck(ctx, func(ctx context.Context) error { return bucketExists(ctx, client, s.Bucket) })
	})
	if err := ensureBucket(ctx, client, s.Bucket); err != nil {
		return fmt.Errorf("S3 bucket %q at %s is unavailable, storage features degrade: %w", s.Bucket, s.Endpoint, err)
	}
	return nil
}

// ensureBucket creates the bucket unless it exists. Two instances booting at
// once may both try: "already owned by you" means the other one won.
func ensureBucket(ctx context.Context, client *minio.Client, bucket string) error {
	exists, err := client.BucketExists(ctx, bucket)
	if err != nil || exists {
		return err
	}
	err = client.MakeBucket(ctx, bucket, minio.MakeBucketOptions{})
	if code := minio.ToErrorResponse(err).Code; code == "BucketAlreadyOwnedByYou" || code == "BucketAlreadyExists" {
		return nil
	}
	return err
}

func bucketExists(ctx context.Context, client *minio.Client, bucket string) error {
	exists, err := client.BucketExists(ctx, bucket)
	if err == nil && !exists {
		err = fmt.Errorf("bucket %q does not exist", bucket)
	}
	return err
}
