/*
 * Preloaded into tritonserver (LD_PRELOAD) by batchlm/server/argv_secret.py: it puts a secret into the
 * arguments main() parses without the secret ever being on the process's command line, which every
 * local user can read in /proc/<pid>/cmdline.
 *
 * The secret comes in the environment variable BATCHLM_ARGV_SECRET (/proc/<pid>/environ is readable by
 * the process's own user only). Before main() runs, each argument that holds the placeholder
 * @BATCHLM_ARGV_SECRET@ is replaced, in the argument vector main() receives, by a copy with the secret
 * in its place; the command line keeps the placeholder. Then the variable's value is overwritten where
 * the kernel shows the environment from, the variable is removed, and this library is taken off
 * LD_PRELOAD (the first entry, where argv_secret.py puts it), so that the processes tritonserver starts
 * (the Python backend stubs) inherit neither; other preloaded libraries stay.
 *
 * glibc calls a shared object's constructors with (argc, argv, envp), and argv is the vector that
 * main() is then called with.
 */
#include <stdlib.h>
#include <string.h>

#define PLACEHOLDER "@BATCHLM_ARGV_SECRET@"
#define VARIABLE "BATCHLM_ARGV_SECRET"

static char *with_secret(const char *arg, const char *at, const char *secret) {
    size_t head = (size_t)(at - arg), secret_len = strlen(secret);
    const char *tail = at + strlen(PLACEHOLDER);
    char *out = malloc(head + secret_len + strlen(tail) + 1);
    if (out == NULL) abort();
    memcpy(out, arg, head);
    memcpy(out + head, secret, secret_len);
    strcpy(out + head + secret_len, tail);
    return out;
}

__attribute__((constructor)) static void put_secret(int argc, char **argv, char **envp) {
    const char *found = getenv(VARIABLE);
    if (found == NULL) return;
    char *secret = strdup(found);
    if (secret == NULL) abort();
    for (int i = 0; i < argc; i++) {
        const char *at = strstr(argv[i], PLACEHOLDER);
        if (at != NULL) argv[i] = with_secret(argv[i], at, secret);
    }
    size_t name_len = strlen(VARIABLE);
    for (char **entry = envp; *entry != NULL; entry++) {
        if (strncmp(*entry, VARIABLE, name_len) == 0 && (*entry)[name_len] == '=') {
            memset(*entry + name_len + 1, 'x', strlen(*entry + name_len + 1));
        }
    }
    unsetenv(VARIABLE);
    const char *preload = getenv("LD_PRELOAD");
    if (preload != NULL) {
        size_t first = strcspn(preload, ": ");
        if (preload[first] == '\0') {
            unsetenv("LD_PRELOAD");
        } else {
            char *rest = strdup(preload + first + 1);
            if (rest == NULL) abort();
            setenv("LD_PRELOAD", rest, 1);
            free(rest);
        }
    }
    memset(secret, 0, strlen(secret));
    free(secret);
}
